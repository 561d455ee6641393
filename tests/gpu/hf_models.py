"""Config-built transformers models for the Hugging Face GPU tests (test_hf_gpu, test_torch_gpu)."""
import copy

import torch


def same_weight_models(cfg, name: str, train: bool = False) -> dict:
    """``ours`` (attention ``name``, bf16), ``sdpa`` (bf16) and ``fp32`` (SDPA, float32) causal LMs
    of ``cfg`` with the same random weights, on the current CUDA device. Each gets a copy of the
    config: transformers may set the attention implementation on the config object it is given,
    which the models would otherwise share."""
    from transformers import AutoModelForCausalLM
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    models = {}
    for key, attn, dtype in (("ours", name, torch.bfloat16), ("sdpa", "sdpa", torch.bfloat16),
                             ("fp32", "sdpa", torch.float32)):
        m = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=attn)
        if models:
            m.load_state_dict(models["ours"].state_dict())
        models[key] = m.to(device=dev, dtype=dtype).train(train)
    return models
