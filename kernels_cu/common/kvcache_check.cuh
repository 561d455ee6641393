// The device-side check of decode metadata (cupyflash/core/guard.py), run by one warp of the first
// kernel a flash_attn_with_kvcache call launches: the append kernel (decode/append.cu) when there
// are new tokens, else the split kernel (decode/split.cu). One warp per sequence checks what the
// host check (cupyflash.checks.check_kvcache_values) checks:
//   0 <= cache_seqlens[b],  cache_seqlens[b] + seqlen_new <= capacity,
//   and (paged) the ids of the pages the sequence uses, block_table[b, j] for
//   j < ceil((cache_seqlens[b] + seqlen_new) / page_size), inside [0, num_pages).
// The first violation of the launch to claim the per-device word `claim` writes one record into
// host memory mapped into the device's address space (`record`, int32 fields below; the code
// last, after a system-scope fence); guard.py reads it on the next call or in check_errors().
// It only reports: the kernels clamp lengths and never dereference a page id outside the pool.
// claim == nullptr: no check (validate=False, or host metadata already checked on the host).
#pragma once

namespace cf {

// Record fields (guard.py decodes them in this order)
enum KvCheckField : int {
    kCheckCode = 0, kCheckBatch = 1, kCheckColumn = 2, kCheckValue = 3, kCheckSeqlenNew = 4,
    kCheckCapacity = 5, kCheckNumPages = 6, kCheckUsedPages = 7, kCheckPaged = 8,
};
// Error codes (record field 0; 0 = no error)
enum KvCheckCode : int { kCheckNegative = 1, kCheckOverCapacity = 2, kCheckBadPage = 3 };

struct KvCheck {
    int* claim;   // per-device word, 0 until a violation claims it (nullptr: no check)
    int* record;  // device address of the mapped host record
};

// Sequence b's metadata, its length `len` already loaded; called by all 32 lanes of one warp
// (lane = threadIdx.x % 32). `bt_row`: block_table row b, or nullptr for a contiguous cache.
__device__ __forceinline__ void check_kvcache_sequence(const KvCheck& chk, int b, int len,
                                                       const int* bt_row, int seqlen_new,
                                                       int capacity, int page_size,
                                                       int num_pages) {
    const int lane = threadIdx.x & 31;
    const long long total = (long long)len + seqlen_new;
    int code = 0, col = -1, value = len, used = 0;
    if (len < 0) {
        code = kCheckNegative;
    } else if (total > capacity) {
        code = kCheckOverCapacity;
    } else if (bt_row != nullptr) {
        // the first bad column of the pages in use (the host check reports the first too)
        used = (int)((total + page_size - 1) / page_size);
        int bad = 0x7fffffff;
        for (int j = lane; j < used; j += 32) {
            const int id = bt_row[j];
            if (id < 0 || id >= num_pages) {
                bad = j;
                break;  // later columns of this lane are larger
            }
        }
        bad = __reduce_min_sync(0xffffffffu, bad);
        if (bad != 0x7fffffff) {
            code = kCheckBadPage;
            col = bad;
            value = bt_row[bad];
        }
    }
    if (code == 0 || lane != 0 || atomicCAS(chk.claim, 0, 1) != 0) return;
    volatile int* r = chk.record;
    r[kCheckBatch] = b; r[kCheckColumn] = col; r[kCheckValue] = value;
    r[kCheckSeqlenNew] = seqlen_new; r[kCheckCapacity] = capacity; r[kCheckNumPages] = num_pages;
    r[kCheckUsedPages] = used; r[kCheckPaged] = bt_row != nullptr;
    __threadfence_system();
    r[kCheckCode] = code;  // last: guard.py reads a record whose code is set
    __threadfence_system();
}

}  // namespace cf
