"""Helpers for the reward tests: tiny offline models (no downloads) and what a sandbox run may have left behind.

The models (a random sequence-classification RM and judge LMs) use the byte-level tokenizer of
`common.model.build_tiny_tokenizer` and are saved as ordinary HF folders, so they load exactly like a real
`rm_model` / `judge_model` path.
"""

from __future__ import annotations

import os
import tempfile


def _proc_table() -> dict[int, tuple[int, int, bytes, bool]]:
    """pid -> (parent pid, uid, cmdline, zombie) for every process."""
    from rewards._sandbox_tree import proc_stats

    table = {}
    for pid, fields in proc_stats().items():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            table[pid] = (int(fields[1]), os.stat(f"/proc/{pid}").st_uid, cmd, fields[0] == b"Z")
        except OSError:  # gone since
            continue
    return table


def sandbox_processes() -> list[int]:
    """Pids of anything a sandbox of this process (or its children) left running: a launcher below this process,
    or any process with a sandbox uid made by this process or one of its children (the uid encodes the creating
    pid, so concurrent test runs on the same machine do not see each other's). Zombies run nothing: skipped."""
    from rewards.sandbox import UID_BASE

    table = _proc_table()
    mine, todo = {os.getpid()}, [os.getpid()]
    while todo:
        parent = todo.pop()
        for pid, (ppid, *_) in table.items():
            if ppid == parent and pid not in mine:
                mine.add(pid)
                todo.append(pid)
    creators = {pid % (1 << 22) for pid in mine}
    left = []
    for pid, (_, uid, cmd, zombie) in table.items():
        if zombie or pid == os.getpid():
            continue
        if (b"_sandbox_launch" in cmd and pid in mine) or (
                uid >= UID_BASE and (uid - UID_BASE) // 64 in creators):
            left.append(pid)
    return left


def sandbox_leftovers(creators: set[int] | None = None) -> dict[str, list]:
    """Everything sandbox runs of `creators` (default: this process) may leave behind: processes, working
    folders, cgroups. Empty lists when clean."""
    from rewards import _sandbox_tree
    from rewards.sandbox import WORKDIR_PREFIX

    creators = creators or {os.getpid()}
    prefixes = tuple(f"{WORKDIR_PREFIX}{pid}-" for pid in creators)
    folders = [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(prefixes)]
    groups = []
    if _sandbox_tree.kind() == "cgroup-v2":
        bases = [_sandbox_tree._v2_base()]
    elif _sandbox_tree.kind() == "cgroup-v1":
        bases = list(_sandbox_tree._v1_bases().values())
    else:
        bases = []
    cg_prefixes = tuple(f"{_sandbox_tree.PREFIX}{pid}-" for pid in creators)
    for base in bases:
        groups += [f"{base}/{n}" for n in os.listdir(base) if n.startswith(cg_prefixes)]
    return {"processes": sandbox_processes(), "folders": folders, "cgroups": groups}


def _tokenizer():
    from common.model import build_tiny_tokenizer

    return build_tiny_tokenizer()


def _config(tokenizer, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id, **extra)


def build_tiny_rm(path: str, seed: int = 0) -> str:
    """A random 2-layer LlamaForSequenceClassification (one logit) + tokenizer saved at `path`."""
    import torch
    from transformers import LlamaForSequenceClassification

    tokenizer = _tokenizer()
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(_config(tokenizer, num_labels=1))
    with torch.no_grad():  # spread the random head so different texts get clearly different scores
        model.score.weight.mul_(20)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_tiny_judge(path: str, kind: str = "random", seed: int = 0) -> str:
    """A tiny causal LM judge saved at `path`:
    - "random": random weights;
    - "uniform": an all-zero output layer, so every token has probability 1/V and P(yes) = 1/(1+V) exactly
      ("yes" is three bytes, "no" two): it always says no;
    - "yes": the residual stream carries only the token embedding (attention and MLP outputs zeroed) and the
      output layer is wired so that after the prompt's last token "y", "e", "s" follow with near certainty and
      "n" is near impossible: it always says yes.
    """
    import torch
    from transformers import LlamaForCausalLM

    tokenizer = _tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_config(tokenizer, tie_word_embeddings=False))
    with torch.no_grad():
        if kind == "uniform":
            model.lm_head.weight.zero_()
        elif kind == "yes":
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            emb, head = model.model.embed_tokens.weight, model.lm_head.weight
            emb.zero_()
            head.zero_()
            tid = {c: tokenizer.convert_tokens_to_ids(tokenizer.tokenize(c))[0] for c in "yesn"}
            last = tokenizer.convert_tokens_to_ids(tokenizer.tokenize("\n"))[0]  # the chat prompt's last token
            for dim, (src, dst) in enumerate([(last, "y"), (tid["y"], "e"), (tid["e"], "s")]):
                emb[src, dim] = 1.0
                head[tid[dst], dim] = 10.0
            head[tid["n"], 0] = -10.0
        elif kind != "random":
            raise ValueError(f"unknown judge kind {kind!r}")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
