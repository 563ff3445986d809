"""The CPU kernels: the C++ decode/verify kernel (``kernel``, built by ``build`` from ``csrc/``) and the tiled extend
over ATen's CPU flash kernel (``extend_flash``)."""
