"""conform: the installed KTransformers fork's own staging code, run on CPU.

- ``fork``: find the installed sglang-kt (and kt-kernel), compile its
  ``SharedFullContext`` from the file; ``requirements``: what that class's
  ``load`` reaches, read from its AST;
- ``fence``: ``--patch-fence``, the seed PR's reader fence derived from the AST;
- ``sim_cuda``, ``env``: the simulated CUDA runtime and the names the fork's module
  resolves to (gloo TP groups, stand-ins for affinity and NUMA);
- ``slow_peer``: the deterministic late-reader schedule;
- ``writer``: moetrace's writer, the stand-in for kt-kernel's; ``kt_wrapper``: kt-kernel's,
  built as the fork builds it;
- ``marlin``: what INT4's staging calls after the copy (SGLang's own scale permute, the
  Marlin repack as a recorded identity);
- ``rank``: one TP rank process running cases;
- ``releases``: installing sglang-kt releases with their kt-kernel into a cache.

The job driver is ``moetrace.jobs.conform``; docs/conform.md.
"""
