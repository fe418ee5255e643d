"""A judge model tandem serves itself (`--judge-model PATH --judge-device cpu|cuda:N` without `--judge-url`): a small
OpenAI-compatible server (POST /v1/chat/completions, GET /v1/models) over a causal LM on transformers (`HFJudge`) or
one the explorer hands over (`--judge-engine vllm`: common/explorer/judge_vllm.py), on 127.0.0.1, in a process of its
own on its own device (the memory planner counts it there and the placement gives it a GPU: common/memory.py
`judge_bytes`, common/placement.py).

A request whose `response_format` is a JSON schema with one `score` number (or a `scores` list of n numbers) in
[0, MAX] is answered by constrained decoding: after the chat template and the forced prefix `{"score": `, the
model's probabilities of the replies 0..MAX (each closed as the schema wants, compared by log-likelihood, as the
K-12 judge's yes/no) give the expected score, so even a small model's reply always parses and its scores are
continuous (a GRPO group rarely ties). Any other request is plain greedy generation up to `max_tokens`.

`JudgeServer` is the pool's handle: the process starts on the first judge call (from that call's thread), says
its port when its model is loaded, and is restarted if it died. Standalone: `python -m rewards.judge_server
--model PATH --device cpu --port 8000` serves the same API to any client.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rewards.judge import Endpoint, JudgeError

MAX_BODY = 16 << 20  # bytes of one request


def load(name: str, device: str):
    """(tokenizer, model) in eval mode: a folder or hub id, or 'default' / 'tiny' as --model takes them."""
    from common.model import load_model, load_tokenizer

    return load_tokenizer(name), load_model(name, device).eval()


def defang(tokenizer, text: str) -> str:
    """`text` with each of the tokenizer's special tokens written in it broken by a zero-width space: it reads
    as text, never as a turn boundary or an end of sequence."""
    for token in sorted(set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab()), key=len, reverse=True):
        if len(token) > 1:
            text = text.replace(token, token[0] + "\u200b" + token[1:])
    return text


def chat_text(tokenizer, messages: list[dict]) -> str:
    messages = [{**m, "content": defang(tokenizer, m["content"])} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n\n".join(m["content"] for m in messages) + "\n\n"


def schema_scores(response_format) -> tuple[str, int, int] | None:
    """(field, count, maximum) of a judgement schema (rewards/judge.py `response_format`), None for anything else."""
    try:
        props = response_format["json_schema"]["schema"]["properties"]
        (name, spec), = props.items()
        if name == "score":
            return name, 1, int(spec["maximum"])
        if name == "scores":
            return name, int(spec["minItems"]), int(spec["items"]["maximum"])
    except (KeyError, TypeError, ValueError):
        return None
    return None


class HFJudge:
    """The judge on transformers, in this process: the prompt's forward once, then every continuation over its
    cached keys and values, as one padded batch."""

    def __init__(self, name: str, device: str):
        self.tokenizer, self.model = load(name, device)

    def continuation_logprobs(self, prefix_ids: list[int], rows: list[list[int]]) -> list[float]:
        """log p(row | prefix) of each row of token ids."""
        import torch

        model = self.model
        width = max(map(len, rows))
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=model.device)
        mask = torch.tensor([[1] * (len(prefix_ids) + len(r)) + [0] * (width - len(r)) for r in rows],
                            device=model.device)
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([prefix_ids], device=model.device), use_cache=True)
            first = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            out.past_key_values.batch_repeat_interleave(len(rows))
            logits = model(input_ids=ids, attention_mask=mask, past_key_values=out.past_key_values).logits
        rest = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(2, ids[:, 1:, None])[..., 0]
        return [(first[r[0]] + rest[k, :len(r) - 1].sum()).item() for k, r in enumerate(rows)]

    def generate(self, ids: list[int], max_tokens: int) -> list[int]:
        import torch

        tokenizer = self.tokenizer
        with torch.inference_mode():
            prompt = torch.tensor([ids], device=self.model.device)
            out = self.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_tokens,
                                      do_sample=False, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        return out[0, len(ids):].tolist()


def load_judge(name: str, device: str, loader=None, max_model_len: int = 0):
    """The judge model: `loader(name, device, max_model_len)` (the explorer's engine for it, e.g.
    common/explorer/judge_vllm.py `VLLMJudge`), or `HFJudge` when none is given."""
    return loader(name, device, max_model_len) if loader is not None else HFJudge(name, device)


def constrained_scores(judge, messages: list[dict], name: str, count: int, maximum: int) -> list[float]:
    """The expected value of each score under the model, the reply forced to the schema's shape."""
    import torch

    tokenizer = judge.tokenizer
    text = chat_text(tokenizer, messages) + ('{"score": ' if name == "score" else '{"scores": [')
    values = list(range(maximum + 1))
    out = []
    for k in range(count):
        close = "}" if name == "score" else ("]}" if k == count - 1 else ",")
        prefix = tokenizer(text, add_special_tokens=False)["input_ids"]
        rows = [tokenizer(f"{v}{close}", add_special_tokens=False)["input_ids"] for v in values]
        lp = torch.tensor(judge.continuation_logprobs(prefix, rows))
        probs = torch.softmax(lp, dim=0)
        out.append(round(float((probs * torch.tensor(values, dtype=torch.float32)).sum()), 4))
        text += f"{values[int(probs.argmax())]}{close} "
    return out


def generate(judge, messages: list[dict], max_tokens: int) -> str:
    ids = judge.tokenizer(chat_text(judge.tokenizer, messages), add_special_tokens=False)["input_ids"]
    return judge.tokenizer.decode(judge.generate(ids, max_tokens), skip_special_tokens=True)


def make_handler(judge, model_name: str):
    lock = threading.Lock()  # one forward at a time on the model

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, code: int, body: dict):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path.rstrip("/") == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": model_name, "object": "model"}]})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            if self.path.rstrip("/") != "/v1/chat/completions":
                self._send(404, {"error": {"message": f"no route {self.path}"}})
                return
            try:
                size = int(self.headers.get("Content-Length", "0"))
                if not 0 < size <= MAX_BODY:
                    raise ValueError(f"body of {size} bytes")
                body = json.loads(self.rfile.read(size))
                messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in body["messages"]]
                wanted = schema_scores(body.get("response_format"))
                with lock:
                    if wanted:
                        name, count, maximum = wanted
                        scores = constrained_scores(judge, messages, name, count, maximum)
                        content = json.dumps({name: scores[0] if name == "score" else scores})
                    else:
                        content = generate(judge, messages, int(body.get("max_tokens") or 64))
            except (ValueError, KeyError, TypeError) as e:
                self._send(400, {"error": {"message": f"{type(e).__name__}: {e}"}})
                return
            except Exception as e:  # noqa: BLE001  (e.g. out of memory: fail this request, keep serving)
                self._send(500, {"error": {"message": f"{type(e).__name__}: {e}"}})
                return
            self._send(200, {"object": "chat.completion", "model": model_name, "created": int(time.time()),
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": content}}]})

    return Handler


def start_server(name: str, device: str, port: int = 0, loader=None, max_model_len: int = 0) -> ThreadingHTTPServer:
    """The model loaded (`load_judge`) and bound to 127.0.0.1:port (0: any free port), not yet serving."""
    server = ThreadingHTTPServer(("127.0.0.1", port), make_handler(load_judge(name, device, loader, max_model_len),
                                                                   name))
    server.daemon_threads = True
    return server


def serve(conn, name: str, device: str, loader, max_model_len: int, parent_pid: int):
    """The judge server process: load, bind, say ("ready", port) (or ("error", why)), serve until killed."""
    from common.runtime.procs import die_with_parent, guard_group

    die_with_parent(parent_pid)
    if loader is not None:  # (vLLM's engine core outlives a killed owner: the group guard ends it with this process)
        guard_group()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        server = start_server(name, device, loader=loader, max_model_len=max_model_len)
    except Exception as e:  # noqa: BLE001  (a bad path or device: the calls fail with this reason)
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", server.server_address[1]))
    server.serve_forever()


class JudgeServer:
    """The pool's handle on its served judge. `start` runs on the pool's dispatcher thread (the server dies with
    the thread that started it: it must be a long-lived one): it starts the process, or restarts it if it died.
    `endpoint` (on judge-call threads) waits for the model to load, at most `load_timeout_s`."""

    def __init__(self, ctx, model: str, device: str, load_timeout_s: float = 600.0, on_start=None, on_stop=None,
                 loader=None, max_model_len: int = 0):
        self.ctx, self.model, self.device, self.load_timeout_s = ctx, model, device, load_timeout_s
        self.loader, self.max_model_len = loader, max_model_len  # (load_judge)
        self.on_start, self.on_stop = on_start or (lambda p: None), on_stop or (lambda p: None)
        self.proc = self.conn = None
        self.port: int | None = None
        self.error: str | None = None
        self.restarts = 0
        self._lock = threading.Lock()

    @property
    def ready(self) -> bool:
        return self.port is not None

    def start(self):
        with self._lock:
            if self.proc is not None and self.proc.is_alive():
                return
            if self.proc is not None:
                self.restarts += 1
                self._stop()
            parent, child = self.ctx.Pipe(duplex=False)
            # non-daemon: vLLM starts processes of its own; the pool's exit-time finalizer (on_start) kills it
            self.proc = self.ctx.Process(target=serve, name="judge-server", daemon=False,
                                         args=(child, self.model, self.device, self.loader, self.max_model_len,
                                               os.getpid()))
            self.proc.start()
            child.close()
            self.on_start(self.proc)
            self.conn, self.port, self.error = parent, None, None

    def endpoint(self) -> Endpoint:
        with self._lock:
            if self.port is None and self.error is None:
                self._wait_ready()
            if self.error is not None:
                raise JudgeError(self.error)
            return Endpoint(f"http://127.0.0.1:{self.port}/v1", self.model)

    def _wait_ready(self):
        where = f"error: judge server {self.model} on {self.device}"
        try:
            if not self.conn.poll(self.load_timeout_s):
                self.error = f"{where} did not load in {self.load_timeout_s:g}s"
                return
            status, value = self.conn.recv()
        except (EOFError, OSError):
            self.error = f"{where} exited while loading (exit code {self.proc.exitcode})"
            return
        if status == "ready":
            self.port = value
        else:
            self.error = f"{where}: {value}"

    def _stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.join(timeout=5)
            self.on_stop(self.proc)
            self.conn.close()
        self.proc = self.conn = self.port = None

    def close(self):
        with self._lock:
            self._stop()


def main():
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="causal LM folder or hub id ('default', 'tiny' too)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    server = start_server(args.model, args.device, args.port)
    print(f"judge {args.model} on http://127.0.0.1:{server.server_address[1]}/v1", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
