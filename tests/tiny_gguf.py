"""A small GGUF file written here from an HF Qwen2 model directory (F32 tensors, its byte-level BPE tokenizer): what
a GGUF test converts without the package index."""

from __future__ import annotations

import json
from pathlib import Path


def write_gguf(model_dir, path) -> Path:
    """`model_dir` (a Qwen2 model with a fast byte-level BPE tokenizer) as a GGUF file at `path`, under llama.cpp's
    qwen2 tensor names."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    model_dir, path = Path(model_dir), Path(path)
    config = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tokens = sorted(tok["model"]["vocab"].items(), key=lambda item: item[1])
    added = {t["id"]: t["content"] for t in tok["added_tokens"]}
    names = [added.get(i, token) for token, i in tokens]
    names += [added[i] for i in sorted(added) if i >= len(names)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    weights = load_file(str(model_dir / "model.safetensors"))

    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name("tiny")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(float(config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta")))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(names)
    writer.add_token_types([gguf.TokenType.CONTROL if i in added else gguf.TokenType.NORMAL
                            for i in range(len(names))])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    embed = weights["model.embed_tokens.weight"]
    writer.add_tensor("token_embd.weight", embed.astype(np.float32))
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"].astype(np.float32))
    writer.add_tensor("output.weight", weights.get("lm_head.weight", embed).astype(np.float32))
    for i in range(config["num_hidden_layers"]):
        for hf, short in layer.items():
            for kind in ("weight", "bias"):
                key = f"model.layers.{i}.{hf}.{kind}"
                if key in weights:
                    writer.add_tensor(f"blk.{i}.{short}.{kind}", weights[key].astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
