"""moetrace's model loader for vLLM: the default loader, plus a capture at the load
boundary and the forward hooks, registered through vLLM's public
``register_model_loader`` for the load formats that read safetensors checkpoints.

A worker builds its model with ``get_model`` -> ``get_model_loader(load_config)`` ->
``loader.load_model`` (``model_executor/model_loader/base_loader.py``): create the
model, ``load_weights``, then ``process_weights_after_loading`` (where vLLM's kernels
repack the experts). Overriding the two methods sees the model right after
``load_weights`` (the checkpoint's bytes, before any repack) and once it is final.
Everything moetrace does there is hooks.vllm.session's, which never raises.
"""

from __future__ import annotations

from vllm.model_executor.model_loader import DefaultModelLoader, get_model_loader, register_model_loader

# DefaultModelLoader's formats that read safetensors files as the checkpoint has them
# ("auto" is vLLM's default); a server started with another --load-format is not traced.
FORMATS = ("auto", "safetensors")


class TracingModelLoader(DefaultModelLoader):
    """DefaultModelLoader that tells moetrace's session when the weights are loaded and
    when the model is final."""

    moetrace_config: dict = {}

    def load_model(self, vllm_config, model_config, prefix: str = ""):
        from moetrace.hooks.vllm import session

        self._moetrace_vllm_config = vllm_config
        model = super().load_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
        session.model_ready(self.moetrace_config, model, vllm_config, model_config)
        return model

    def load_weights(self, model, model_config) -> None:
        from moetrace.hooks.vllm import session

        super().load_weights(model, model_config)
        session.weights_loaded(self.moetrace_config, model, getattr(self, "_moetrace_vllm_config", None), model_config)


def install(config: dict) -> None:
    """Register TracingModelLoader (carrying `config`) for FORMATS; idempotent."""
    from vllm.config.load import LoadConfig

    TracingModelLoader.moetrace_config = dict(config)
    for fmt in FORMATS:
        if not isinstance(get_model_loader(LoadConfig(load_format=fmt)), TracingModelLoader):
            register_model_loader(fmt)(TracingModelLoader)
