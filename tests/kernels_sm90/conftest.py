"""The sm90 kernel tests: Triton kernels run on the GPU or in Triton's CPU interpreter (`device`, tests/conftest.py);
the CuTe DSL kernels are compiled for sm_90a everywhere but run only on a GPU (tests marked ``gpu``)."""
