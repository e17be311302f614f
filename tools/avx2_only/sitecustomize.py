"""Make this process and its children look like an AVX2-only x86-64 CPU (an AMD EPYC of the Zen 2/3 kind) on a
machine that has AVX-512: ``tools/golden_across_isa.py`` puts this folder on PYTHONPATH beside the variables
that restrict PyTorch's, oneDNN's and MKL's kernels (``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``,
``MKL_ENABLE_INSTRUCTIONS=AVX2``).

Those variables do not reach vLLM's choice of compiled ops: ``vllm/platforms/cpu.py`` ``import_kernels`` loads
``_C`` (AVX-512 with bf16), ``_C_AVX512`` or ``_C_AVX2`` by ``torch.cpu._is_avx512_supported()``, which reads
the CPU's flags (``torch.cpu.get_capabilities()``). Here those flags lose every AVX-512 entry as ``torch.cpu`` is
imported, so vLLM loads ``_C_AVX2`` as it would on the AVX2-only CPU."""

import importlib.abc
import importlib.util
import os
import sys

if os.environ.get("ATEN_CPU_CAPABILITY") == "avx2":
    # torch inductor's on-disk cache does not tell kernels compiled for AVX-512 from AVX2 ones: a kernel an
    # unrestricted process compiled (vLLM's vocab-parallel embedding mask) and a restricted one then loaded gave
    # garbage indices. An AVX2-only machine never sees AVX-512 kernels: its own cache folder.
    import getpass
    import tempfile

    _cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(),
                                                                        f"torchinductor_{getpass.getuser()}")
    if not _cache.endswith("-avx2"):  # the processes this one starts inherit it
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = _cache + "-avx2"

    class _AVX2Only(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "torch.cpu":
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                real = module.get_capabilities
                module.get_capabilities = lambda: {k: v for k, v in real().items() if not k.startswith("avx512")}

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _AVX2Only())
