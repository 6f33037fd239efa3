"""Tiny random-weight GGUF files for the llama.cpp engine, one per kind of model state: plain KV
(llama), a sliding window (gemma2), recurrent state (mamba) and a hybrid of short convolutions and
attention (lfm2). A 320-token SentencePiece vocab; 2-D weights in F16, which llama.cpp multiplies
with its sgemm kernels for batches of two tokens or more (SmolLM2's Q4_1 never takes that path).
Written with gguf-py in milliseconds; nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

KINDS = ("llama", "gemma2", "mamba", "lfm2")
VOCAB = 320
EMBD, FF, HEADS, KV_HEADS, LAYERS, CONTEXT = 64, 128, 4, 2, 4, 512


def write_tiny_gguf(path: Path, kind: str, seed: int = 0, chat_template: str | None = None) -> Path:
    """A random-weight GGUF of ``kind``; gemma2's sliding window is 8 tokens."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), kind)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(EMBD)
    w.add_block_count(LAYERS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    tensors = {}

    def mat(name, rows, cols):  # numpy shape (rows, cols) = ggml {cols, rows}
        tensors[name] = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float16)

    def vec(name, n, value=None):
        tensors[name] = (np.full(n, value, np.float32) if value is not None
                         else (1 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", VOCAB, EMBD)
    head = EMBD // HEADS
    if kind in ("llama", "gemma2"):
        w.add_feed_forward_length(FF)
        w.add_head_count(HEADS)
        w.add_head_count_kv(KV_HEADS)
        w.add_rope_dimension_count(head)
        if kind == "gemma2":
            w.add_sliding_window(8)
        vec("output_norm.weight", EMBD)
        for i in range(LAYERS):
            b = f"blk.{i}."
            vec(b + "attn_norm.weight", EMBD)
            mat(b + "attn_q.weight", HEADS * head, EMBD)
            mat(b + "attn_k.weight", KV_HEADS * head, EMBD)
            mat(b + "attn_v.weight", KV_HEADS * head, EMBD)
            mat(b + "attn_output.weight", EMBD, HEADS * head)
            vec(b + "ffn_norm.weight", EMBD)
            mat(b + "ffn_gate.weight", FF, EMBD)
            mat(b + "ffn_up.weight", FF, EMBD)
            mat(b + "ffn_down.weight", EMBD, FF)
            if kind == "gemma2":
                vec(b + "post_attention_norm.weight", EMBD)
                vec(b + "post_ffw_norm.weight", EMBD)
    elif kind == "mamba":
        inner, state, rank, conv = 2 * EMBD, 8, 8, 4
        w.add_ssm_conv_kernel(conv)
        w.add_ssm_inner_size(inner)
        w.add_ssm_state_size(state)
        w.add_ssm_time_step_rank(rank)
        vec("output_norm.weight", EMBD)
        for i in range(LAYERS):
            b = f"blk.{i}."
            vec(b + "attn_norm.weight", EMBD)
            mat(b + "ssm_in.weight", 2 * inner, EMBD)
            tensors[b + "ssm_conv1d.weight"] = (rng.standard_normal((inner, conv)) / 2).astype(np.float32)
            vec(b + "ssm_conv1d.bias", inner, 0.0)
            mat(b + "ssm_x.weight", rank + 2 * state, inner)
            mat(b + "ssm_dt.weight", inner, rank)
            vec(b + "ssm_dt.bias", inner, -2.0)
            tensors[b + "ssm_a"] = -np.exp(rng.standard_normal((inner, state))).astype(np.float32)
            vec(b + "ssm_d", inner, 1.0)
            mat(b + "ssm_out.weight", EMBD, inner)
    elif kind == "lfm2":
        attention = [1, 3]  # the other layers are short convolutions
        w.add_feed_forward_length(FF)
        w.add_head_count(HEADS)
        w.add_head_count_kv([KV_HEADS if i in attention else 0 for i in range(LAYERS)])
        w.add_rope_dimension_count(head)
        w.add_uint32("lfm2.shortconv.l_cache", 3)
        vec("token_embd_norm.weight", EMBD)
        for i in range(LAYERS):
            b = f"blk.{i}."
            vec(b + "attn_norm.weight", EMBD)
            vec(b + "ffn_norm.weight", EMBD)
            mat(b + "ffn_gate.weight", FF, EMBD)
            mat(b + "ffn_up.weight", FF, EMBD)
            mat(b + "ffn_down.weight", EMBD, FF)
            if i in attention:
                vec(b + "attn_q_norm.weight", head)
                vec(b + "attn_k_norm.weight", head)
                mat(b + "attn_q.weight", EMBD, EMBD)
                mat(b + "attn_k.weight", KV_HEADS * head, EMBD)
                mat(b + "attn_v.weight", KV_HEADS * head, EMBD)
                mat(b + "attn_output.weight", EMBD, EMBD)
            else:
                tensors[b + "shortconv.conv.weight"] = (rng.standard_normal((EMBD, 3)) / 2).astype(np.float32)
                mat(b + "shortconv.in_proj.weight", 3 * EMBD, EMBD)
                mat(b + "shortconv.out_proj.weight", EMBD, EMBD)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += [f"\u2581w{i}" for i in range(VOCAB - len(pieces))]
    w.add_tokenizer_model("llama")
    if chat_template:
        w.add_chat_template(chat_template)
    w.add_token_list(pieces)
    w.add_token_scores([0.0] * 3 + [0.0] * 256 + [-float(i) for i in range(VOCAB - 259)])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (VOCAB - 259))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
