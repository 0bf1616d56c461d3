"""GPU fast paths: FlashInfer attention, CUDA-graph decode, fused elementwise kernels.

None of this is needed to follow the lessons: each fast path has a plain-torch reference
(`minisgl/models/`) that the CPU runs and the tests compare against.
"""
