"""SGLang's own model loading as the oracle of a complete checkpoint (tests only): in the
real server's environment (.venv-sglang, CPU engine, TP1), each folder's model class is
built by SGLang's own loader (ModelConfig and its CPU head adjustment, the quantization
config, the architecture registry, DefaultModelLoader.load_model) and its own ``load_weights`` reads the folder;
then every parameter row the loader never wrote is reported.

Before loading, every parameter byte is set to 0xA5; a row (the last dimension) still all
0xA5 after loading was never written (no bf16, fp32 or fp8 value a checkpoint holds is a
whole row of 0xA5 bytes: 0xA5A5 is -2.9e-16 in bf16, 0xA5A5A5A5 -2.9e-16 in fp32, and the
synthetic fp8 values never fill a row with one byte). Post-load processing (AMX packing,
FP8 requantization) is not run: it is not about which tensors the folder holds.

    python -m support.sglang_model_load FOLDER...   (prints one JSON line per folder)
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback

SENTINEL = 0xA5


def unfilled_rows(model) -> dict[str, int]:
    """Parameter name -> how many of its rows hold only the sentinel."""
    import torch

    out = {}
    for name, p in model.named_parameters():
        if p.numel() == 0 or getattr(p, "_skip_weight_check", False):  # SGLang's mark: not read from
            continue  # the checkpoint (KV-cache scales, defaulted after loading)
        data = p.data.contiguous()
        rows = data.reshape(-1, data.shape[-1] if data.dim() else 1).view(torch.uint8)
        count = int((rows == SENTINEL).all(dim=1).sum())
        if count:
            out[name] = count
    return out


class Oracle:
    """One process, several folders: the parallel runtime is set up once (TP1, gloo)."""

    def __init__(self):
        self.started = False

    def _publish(self, path: str):
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.distributed import bootstrap
        from sglang.srt.runtime_context import SpawnRanks, publish
        from sglang.srt.server_args import ServerArgs

        args = ServerArgs(model_path=path, device="cpu", tp_size=1, attention_backend="torch_native",
                          sampling_backend="pytorch", disable_cuda_graph=True, skip_server_warmup=True,
                          disable_radix_cache=True)  # hybrid (Mamba-cache) models need it on CPU
        publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
        config = ModelConfig.from_server_args(args)
        if not self.started:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            bootstrap.init_parallel_runtime(server_args=args, device="cpu", dist_port=port)
            self.started = True
        bootstrap.init_layer_runtime(model_config=config)
        return config

    def check(self, path: str) -> dict:
        import torch
        from sglang.srt.configs.device_config import DeviceConfig
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.configs.update_config import adjust_config_with_unaligned_cpu_tp
        from sglang.srt.model_loader import loader

        seen = {}

        def load_only(model, weights, target_device):
            for p in model.parameters():
                p.data.view(-1).view(torch.uint8).fill_(SENTINEL)
            loader.DefaultModelLoader.load_weights_only(model, weights, target_device)
            seen["unfilled"] = unfilled_rows(model)
            seen["parameters"] = sum(1 for _ in model.parameters())
            seen["model_class"] = type(model).__name__

        saved = loader.DefaultModelLoader.load_weights_and_postprocess
        loader.DefaultModelLoader.load_weights_and_postprocess = staticmethod(load_only)
        try:
            config = self._publish(path)
            load_config = LoadConfig(load_format="auto")
            # as ModelRunner.load_model does on CPU (it sets the *_cpu head counts the model classes read)
            config = adjust_config_with_unaligned_cpu_tp(config, load_config, 1)
            loader.get_model_loader(load_config, config).load_model(model_config=config,
                                                                    device_config=DeviceConfig("cpu"))
        except Exception as err:  # reported, not raised: the next folder still runs
            return {"path": path, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]}
        finally:
            loader.DefaultModelLoader.load_weights_and_postprocess = saved
        return {"path": path, "error": None, **seen}


def main(paths: list[str]) -> None:
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    import sgl_kernel  # noqa: F401  the stand-in (tests/support/sglang_cpu) before SGLang's model registry

    oracle = Oracle()
    for path in paths:
        print(json.dumps(oracle.check(path)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
