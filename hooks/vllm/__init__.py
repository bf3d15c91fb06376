"""moetrace inside a vLLM server: the ``vllm.general_plugins`` entry point (plugin), the
wrapped model loader that captures at the load boundary and registers the forward hooks
(loader, session), the MoE layers as vLLM builds them (experts), what its kernels do to
the expert bytes (kernel_layout). How a vLLM server command is launched is
servers.vllm_command's.
Importing this package, or ``plugin``, loads nothing but the standard library."""
