"""Calls into TE's C++ extension and quantizers, with as little Python per call as TE's kernels
allow; no op registrations (those are in ops/). Run inside op kernels only, never at trace time.

- extension.py: transformer_engine_torch itself: GEMM with TE's workspace, quantize,
  DelayedScaling state binding.
- fp8_operands.py, operands_mx.py: TE quantizers built once per config; quantized operands
  taken apart into plain tensors and put back together across op boundaries.
- gemm_layer.py: one GEMM layer's forward and backward (every GEMM op's envelope).
- norm.py, activation.py: the prologues/epilogues around GEMMs (TE's norm and activation
  kernels, fused with quantization where TE fuses).
- delayed_update.py, process_groups.py: DelayedScaling's amax/scale update, amax reductions.
- te_dtypes.py: TE's dtype enums.
"""
