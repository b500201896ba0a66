#!/usr/bin/env python3
"""Writes a GGUF Llama model of a real shape with seeded random weights.

The file is for measuring speed and memory on machines that cannot download the real model: the
shapes, the tensor names and types, and the metadata are those of the named model, so kvsift's
runner (lib/model/llama_weights.cpp, lib/model/tokenizer.cpp) loads it and does the same work per
token; the weights are random, so the text it generates means nothing.

The tokenizer is SmolLM2's byte-level BPE (the file scripts/fetch_model.sh prints), for every
shape. A shape with a larger vocabulary keeps its own vocabulary size for the embedding and output
tensors and lists the extra ids as unused tokens "<|pad_N|>", so that the tokenizer's size equals
token_embd's rows, which lib/model/llama_model.cpp requires.

Memory: tensors are generated, quantized and written one at a time (GGUFWriter.add_tensor_info for
all of them first, then write_tensor_data per tensor), and each tensor is generated and quantized in
row chunks of about 4M values. The peak is therefore about one tensor in its output type plus a few
hundred MB: for llama3-8b that is token_embd/output, 128256 x 4096, at 1.05 GB in bf16, 0.56 GB in
Q8_0 and 0.30 GB in Q4_0.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import functools
import zlib
from pathlib import Path
from dataclasses import dataclass

import numpy as np

try:
    import gguf
    from gguf import GGMLQuantizationType as QType
    from gguf import GGUFValueType
except ImportError:  # the script still answers --help and explains what to install
    gguf = None

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

DESCRIPTION = ("kvsift synthetic model: seeded random weights in a real model's shape. The text it "
               "generates is meaningless; the timings and memory use are real.")


@dataclass(frozen=True)
class Shape:
    n_layers: int
    n_embd: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_ff: int
    n_vocab: int
    rope_theta: float
    n_ctx: int
    rms_eps: float
    tied_output: bool  # no output.weight: the runner uses token_embd for the logits


# The shapes, from the models' published configurations. Llama 3's 8B has its own output matrix;
# Llama 3.2 1B and SmolLM2 135M tie it to the token embedding.
SHAPES = {
    "llama3-8b": Shape(n_layers=32, n_embd=4096, n_heads=32, n_kv_heads=8, head_dim=128,
                       n_ff=14336, n_vocab=128256, rope_theta=500000.0, n_ctx=131072,
                       rms_eps=1e-5, tied_output=False),
    "llama3.2-1b": Shape(n_layers=16, n_embd=2048, n_heads=32, n_kv_heads=8, head_dim=64,
                         n_ff=8192, n_vocab=128256, rope_theta=500000.0, n_ctx=131072,
                         rms_eps=1e-5, tied_output=True),
    "smollm2-135m": Shape(n_layers=30, n_embd=576, n_heads=9, n_kv_heads=3, head_dim=64,
                          n_ff=1536, n_vocab=49152, rope_theta=100000.0, n_ctx=8192,
                          rms_eps=1e-5, tied_output=True),
}

# --type: the tensor type of the matrices and the file type recorded in general.file_type. Norm
# weights stay float32, as in llama.cpp's files.
TYPES = {"bf16": ("BF16", "MOSTLY_BF16"), "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
         "q4_0": ("Q4_0", "MOSTLY_Q4_0")}

CHUNK_VALUES = 1 << 22  # values generated and quantized at a time

PAD_TOKEN_TYPE = 5  # llama.cpp's LLAMA_TOKEN_TYPE_UNUSED; lib/model/tokenizer.cpp accepts 1..6


class UsageError(Exception):
    """A problem with the arguments or the inputs: reported as one line, exit status 2."""


def tensor_plan(shape: Shape, n_layers: int) -> list[tuple[str, tuple[int, int] | tuple[int]]]:
    """(name, numpy shape) of every tensor, in llama.cpp's order. A matrix is [out, in]: GGUF lists
    its dimensions innermost first, [in, out], which is what lib/model/llama_weights.cpp checks."""
    E, q, kv = shape.n_embd, shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    plan: list = [("token_embd.weight", (shape.n_vocab, E)), ("output_norm.weight", (E,))]
    if not shape.tied_output:
        plan.append(("output.weight", (shape.n_vocab, E)))
    for layer in range(n_layers):
        p = f"blk.{layer}."
        plan += [(p + "attn_norm.weight", (E,)),
                 (p + "attn_q.weight", (q, E)), (p + "attn_k.weight", (kv, E)),
                 (p + "attn_v.weight", (kv, E)), (p + "attn_output.weight", (E, q)),
                 (p + "ffn_norm.weight", (E,)),
                 (p + "ffn_gate.weight", (shape.n_ff, E)), (p + "ffn_up.weight", (shape.n_ff, E)),
                 (p + "ffn_down.weight", (E, shape.n_ff))]
    return plan


def stored_type(dims: tuple, qtype: "QType") -> "QType":
    return qtype if len(dims) == 2 else QType.F32


def stored_bytes(dims: tuple, qtype: "QType") -> np.ndarray:
    """An empty uint8 array of the stored tensor's byte shape."""
    if qtype == QType.F32:
        return np.empty((*dims[:-1], dims[-1] * 4), dtype=np.uint8)
    return np.empty(gguf.quant_shape_to_byte_shape(dims, qtype), dtype=np.uint8)


def make_tensor(name: str, dims: tuple, qtype: "QType", seed: int) -> np.ndarray:
    """The tensor's stored bytes. Norm weights are 1. A matrix [out, in] has standard deviation
    1/sqrt(in): with RMSNorm before every projection, each layer's output stays of order one, the
    residual stream grows like the square root of the layer count, and the logits are of order one.
    The values are uniform on [-sqrt(3/in), sqrt(3/in)] (that standard deviation) rather than
    normal: numpy draws uniform floats several times faster, which matters at 8B values, and the
    distribution changes nothing the runner's timings depend on. The generator is seeded by
    (seed, name), so a tensor's values do not depend on the others (a model cut by --layers has the
    full model's first layers)."""
    out = stored_bytes(dims, qtype)
    if len(dims) == 1:
        out[:] = np.ones(dims, dtype=np.float32).view(np.uint8)
        return out
    rows, cols = dims
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    half_width = np.float32(np.sqrt(3.0 / cols))
    step = max(1, CHUNK_VALUES // cols)
    for first in range(0, rows, step):
        last = min(rows, first + step)
        values = rng.random((last - first, cols), dtype=np.float32)
        values *= 2 * half_width
        values -= half_width
        # gguf.quants (in the pinned version, tools/synthetic_model/requirements.txt) writes the
        # BF16, Q8_0 and Q4_0 block layouts as ggml does.
        out[first:last] = gguf.quants.quantize(values, qtype)
    return out


def default_tokenizer_source() -> str:
    path = os.environ.get("KVSIFT_MODEL", "")
    if path and os.path.exists(path):
        return path
    script = os.path.join(ROOT, "scripts", "fetch_model.sh")
    try:
        run = subprocess.run([script], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        raise UsageError(f"cannot get SmolLM2's file from {script} ({detail.strip()}); "
                         "give it with --tokenizer-from") from None
    return run.stdout.strip()


@functools.lru_cache(maxsize=4)  # tests write several models in one process; reading takes seconds
def read_tokenizer(path: str, n_vocab: int) -> tuple[tuple[str, object, object, object], ...]:
    """The tokenizer.* key-values of the GGUF file at path, as (key, value, type, sub_type), with
    the token list and its types padded to n_vocab entries."""
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: not a readable GGUF file ({e})") from None
    fields = {k: f for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges"):
        if key not in fields:
            raise UsageError(f"{path}: has no {key}; the tokenizer must come from a GGUF file "
                             "with a gpt2-style BPE tokenizer (SmolLM2's)")
    if fields["tokenizer.ggml.model"].contents() != "gpt2":
        raise UsageError(f"{path}: tokenizer.ggml.model is "
                         f"'{fields['tokenizer.ggml.model'].contents()}', not 'gpt2'")
    out = []  # a tuple below: the cached value is shared by the calls
    for key, field in fields.items():
        value = field.contents()
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        if key == "tokenizer.ggml.tokens":
            if len(value) > n_vocab:
                raise UsageError(f"{path}: the tokenizer has {len(value)} tokens, more than the "
                                 f"shape's vocabulary of {n_vocab}")
            value = value + [f"<|pad_{i}|>" for i in range(n_vocab - len(value))]
        elif key == "tokenizer.ggml.token_type":
            value = value + [PAD_TOKEN_TYPE] * (n_vocab - len(value))
        out.append((key, value, vtype, sub_type))
    return tuple(out)


def write_model(args: argparse.Namespace) -> None:
    shape = SHAPES[args.shape]
    n_layers = args.layers if args.layers is not None else shape.n_layers
    qname, ftype = TYPES[args.type]
    qtype = QType[qname]
    tokenizer = read_tokenizer(args.tokenizer_from or default_tokenizer_source(), shape.n_vocab)

    writer = gguf.GGUFWriter(path=None, arch="llama")
    name = f"synthetic {args.shape}" + (f" ({n_layers} of {shape.n_layers} layers)"
                                         if n_layers != shape.n_layers else "")
    writer.add_type("model")
    writer.add_name(name)
    writer.add_description(f"{DESCRIPTION} shape={args.shape} type={args.type} seed={args.seed} "
                           f"layers={n_layers}")
    writer.add_file_type(int(gguf.LlamaFileType[ftype]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(n_layers)
    writer.add_context_length(args.context_length or shape.n_ctx)
    writer.add_embedding_length(shape.n_embd)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_heads)
    writer.add_head_count_kv(shape.n_kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(shape.n_vocab)
    for key, value, vtype, sub_type in tokenizer:
        writer.add_key_value(key, value, vtype, sub_type)

    plan = tensor_plan(shape, n_layers)
    total = 0
    for tname, dims in plan:
        t = stored_type(dims, qtype)
        nbytes = stored_bytes(dims, t).nbytes
        total += nbytes
        writer.add_tensor_info(tname, stored_bytes(dims, t).shape, np.dtype(np.uint8), nbytes,
                               raw_dtype=t)

    print(DESCRIPTION)
    print(f"{args.out}: {args.shape}, {n_layers} layers, {args.type}, seed {args.seed}, "
          f"{len(plan)} tensors, {total / 1e9:.2f} GB of tensor data")
    part = args.out + ".part"
    start = time.monotonic()
    try:
        writer.write_header_to_file(path=Path(part))
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i, (tname, dims) in enumerate(plan):
            writer.write_tensor_data(make_tensor(tname, dims, stored_type(dims, qtype), args.seed))
            if args.progress and sys.stdout.isatty():
                print(f"\r  {i + 1}/{len(plan)} tensors", end="", flush=True)
        writer.close()
        os.replace(part, args.out)
    except OSError as e:
        writer.close()
        if os.path.exists(part):
            os.remove(part)
        raise UsageError(f"writing {args.out}: {e}") from None
    if args.progress and sys.stdout.isatty():
        print()
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 1e9:.2f} GB) in "
          f"{time.monotonic() - start:.1f} s")


def parse_args(argv: list[str]) -> argparse.Namespace:
    shapes = "\n".join(
        f"  {k:<13} {s.n_layers} layers, hidden {s.n_embd}, heads {s.n_heads}/{s.n_kv_heads}, "
        f"head_dim {s.head_dim}, FFN {s.n_ff}, vocab {s.n_vocab}, theta {s.rope_theta:g}, "
        f"context {s.n_ctx}{', tied output' if s.tied_output else ''}"
        for k, s in SHAPES.items())
    p = argparse.ArgumentParser(
        description="Write a GGUF Llama model of a real shape with seeded random weights. "
                    + DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"shapes:\n{shapes}\n\n"
               "Memory: one tensor at a time, generated in chunks of 4M values. Peak RSS is about\n"
               "the largest tensor in its stored type plus ~0.1-0.2 GB: for llama3-8b that tensor\n"
               "is the 128256 x 4096 embedding, 1.05 GB in bf16, 0.56 GB in q8_0, 0.30 GB in q4_0;\n"
               "measured peaks 1.1 GB (bf16) and 0.4 GB (q4_0). Disk: the file's size (llama3-8b:\n"
               "16.1 GB bf16, 8.5 GB q8_0, 4.5 GB q4_0), written to OUT.part, renamed when done.\n\n"
               "example: make_model.py --shape llama3-8b --type q4_0 --seed 1 "
               "--out /tmp/llama3-8b-q4_0.gguf")
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--type", required=True, type=str.lower, choices=sorted(TYPES),
                   help="type of the weight matrices (norm weights are float32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights (default 0)")
    p.add_argument("--out", required=True, help="the GGUF file to write")
    p.add_argument("--layers", type=int, help="write only the first N layers (for tests)")
    p.add_argument("--tokenizer-from", metavar="GGUF",
                   help="GGUF file whose tokenizer.* metadata is copied (default: $KVSIFT_MODEL, "
                        "else the SmolLM2 file that scripts/fetch_model.sh prints)")
    p.add_argument("--context-length", type=int,
                   help="positions the file declares (default: the shape's, 131072 for Llama 3): "
                        "long-context runs past the published window; RoPE is unchanged")
    p.add_argument("--progress", action="store_true", help="print a tensor count on a terminal")
    args = p.parse_args(argv)
    if args.context_length is not None and not 1 <= args.context_length < 2**32:
        p.error(f"--context-length {args.context_length} is not in 1..2^32-1")
    n = SHAPES[args.shape].n_layers
    if args.layers is not None and not 1 <= args.layers <= n:
        p.error(f"--layers {args.layers} is not in 1..{n} for {args.shape}")
    if not 0 <= args.seed < 2**63:
        p.error(f"--seed {args.seed} is not in 0..2^63-1")
    folder = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(folder):
        p.error(f"--out {args.out}: the folder {folder} does not exist")
    if args.tokenizer_from is not None and not os.path.isfile(args.tokenizer_from):
        p.error(f"--tokenizer-from {args.tokenizer_from}: no such file")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if gguf is None:
        print("make_model.py: the gguf package is not installed; install the pinned version with "
              f"pip install -r {os.path.join(HERE, 'requirements.txt')}", file=sys.stderr)
        return 1
    try:
        write_model(args)
    except UsageError as e:
        print(f"make_model.py: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        part = args.out + ".part"
        if os.path.exists(part):
            os.remove(part)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
