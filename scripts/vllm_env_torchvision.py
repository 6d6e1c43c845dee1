"""scripts/vllm_env.sh's torchvision patch: import its op registrations only when its ops loaded.

The torchvision wheels on the package index are built against CUDA torch: their `_C.so` wants
libc10_cuda.so and does not load with CPU torch. torchvision's `__init__` then still imports
`_meta_registrations` and `_autograd_registrations`, which fail with "operator torchvision::nms
does not exist". transformers 5's Qwen2-VL image processor imports torchvision.transforms.v2,
which works without the ops, so the patch makes those two imports depend on the ops having loaded.
Usage: VLLM_PYTHON scripts/vllm_env_torchvision.py (idempotent; fails if torchvision's __init__ changed).
"""
import sysconfig
from pathlib import Path

MARK = "scripts/vllm_env.sh"
OLD = "from torchvision import (\n    _autograd_registrations,\n    _meta_registrations,\n"
NEW = (f"if extension._has_ops():  # {MARK}: a CUDA-built _C does not load with CPU torch\n"
       "    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401\n"
       "from torchvision import (\n")


def main() -> None:
    path = Path(sysconfig.get_paths()["purelib"]) / "torchvision" / "__init__.py"
    source = path.read_text()
    if MARK in source:
        return
    if source.count(OLD) != 1:
        raise SystemExit(f"{path} is not what {MARK} knows; review its torchvision patch")
    path.write_text(source.replace(OLD, NEW))


if __name__ == "__main__":
    main()
