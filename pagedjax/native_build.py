"""What every C++ library we build for this process links against (torch's extension and the
JAX FFI library alike); imports neither torch nor jax."""

from __future__ import annotations


def loaded_libstdcxx_ldflags() -> list[str]:
    """Link the libstdc++ this process has loaded (torch's or jaxlib's), by path, ahead of the
    compiler's own.

    Some toolchains (the GPU machines' /opt/gcc) link libstdc++ statically into every shared
    object; the extension's copy then formats numbers with a locale nobody initialised and a
    TORCH_CHECK naming a number crashed the process. Named first, the loaded library resolves
    every symbol it has, and the static archive only supplies what it lacks.
    """
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libstdc++.so" in line}
    except OSError:  # not Linux
        return []
    return sorted(paths)[:1]
