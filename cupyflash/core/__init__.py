"""Shared machinery of every kernel path: input checks (:mod:`.checks`), array interop with CuPy
and PyTorch (:mod:`.interop`), run-time compilation (:mod:`.jit`), kernel launches and tensor maps
(:mod:`.launch`, :mod:`.tma`), device-side argument checks (:mod:`.guard`), the plan as data and
device facts (:mod:`.planning`), the launch cache (:mod:`.cache`) and the optional dependencies,
imported with an error that says what to install (:mod:`.deps`)."""
