"""`moetrace make-checkpoint`: a small synthetic MoE checkpoint (checkpoints.synthetic)."""

from __future__ import annotations

import click

from moetrace.commands.options import SEED, command

EXAMPLES = (
    "moetrace make-checkpoint --family qwen3_5_moe --format fp8_block \\\n"
    "    --experts 16 --intermediate 512 --files 3 -o /tmp/qwen35-tiny",
)


@command("make-checkpoint", EXAMPLES)
@click.option("--family", type=click.Choice(["qwen3_moe", "qwen3_next", "qwen3_5_moe", "deepseek_v3"]),
              default="qwen3_5_moe", show_default=True,
              help="Model family: sets architecture, config keys and tensor names.")
@click.option("--format", "fmt", type=click.Choice(["fp8_block", "fp8_channel", "fp8_tensor", "bf16", "int4"]),
              default="fp8_block", show_default=True,
              help="Expert weight format: FP8 with block, per-channel or per-tensor scales, BF16, or INT4 "
                   "(compressed-tensors W4A16 pack-quantized, as llm-compressor writes it).")
@click.option("--quant-method", type=click.Choice(["fp8", "compressed-tensors"]), default=None,
              help="quantization_config.quant_method [default: compressed-tensors for fp8_channel and int4, "
                   "else fp8].")
@click.option("--group-size", type=int, default=None,
              help="int4 only: input columns per scale, 32 or 128 [default: 128].")
@click.option("--block", default="128", show_default=True,
              help="fp8_block scale block: N (N x N) or N,K (block_n over output rows, block_k over input columns).")
@click.option("--fused", is_flag=True,
              help="BF16 only: write fused 3-D mlp.experts.gate_up_proj/down_proj (Qwen3.5 BF16 layout).")
@click.option("--layers", type=click.IntRange(min=1), default=2, show_default=True,
              help="num_hidden_layers, dense layers included.")
@click.option("--experts", type=click.IntRange(min=1), default=8, show_default=True,
              help="Routed experts per MoE layer.")
@click.option("--hidden", type=click.IntRange(min=1), default=256, show_default=True, help="hidden_size.")
@click.option("--intermediate", type=click.IntRange(min=1), default=256, show_default=True,
              help="moe_intermediate_size; I/TP must be a multiple of 128 for fp8_block.")
@click.option("--scale-dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="bfloat16",
              show_default=True, help="Stored dtype of the scales (SGLang holds FP8 scales as float32, INT4's as "
                                      "bfloat16).")
@click.option("--files", type=click.IntRange(min=1), default=2, show_default=True,
              help="Safetensors files; >1 writes model.safetensors.index.json.")
@click.option("--dense-layers", type=click.IntRange(min=0), default=0, show_default=True,
              help="Leading dense layers (first_k_dense_replace / mlp_only_layers).")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Changes every value (synthetic_values seed).")
@click.option("-o", "--out", required=True, help="New or empty output directory (written whole or not at all).")
@click.option("--json", "as_json", is_flag=True, help='Print {"path": ..., "identity": ...} instead of the path.')
def make_checkpoint_cmd(family, fmt, quant_method, group_size, block, fused, layers, experts, hidden, intermediate,
                        scale_dtype, files, dense_layers, seed, out, as_json) -> None:
    """Write a small synthetic MoE checkpoint with real names, dtypes and layout.

    Every expert element is a known function of (layer, expert, projection, row,
    column) (moetrace.checkpoints.synthetic.synthetic_values), so expected TP
    shards and wrong-expert bytes can be checked without real weights.
    """
    import json

    from moetrace.checkpoints.reader import open_checkpoint
    from moetrace.checkpoints.synthetic import check_fits_in_memory, parse_block, write_synthetic_checkpoint

    sizes = parse_block(block)
    if fmt == "int4" and group_size is None:
        group_size = 128
    check_fits_in_memory(layers - dense_layers, experts, hidden, intermediate, 2 if fmt == "bf16" else 1)
    path = write_synthetic_checkpoint(
        out, family=family, fmt=fmt, num_layers=layers, num_experts=experts, hidden=hidden, intermediate=intermediate,
        scale_dtype=scale_dtype, num_files=files, dense_layers=dense_layers, seed=seed, fused=fused,
        quant_method=quant_method, block=sizes, group_size=group_size,
    )
    if as_json:
        with open_checkpoint(path) as ckpt:
            click.echo(json.dumps({"path": str(path), "identity": ckpt.identity}))
    else:
        click.echo(str(path))
