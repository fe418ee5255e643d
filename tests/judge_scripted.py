"""A scripted judge for the tests: a real OpenAI-compatible HTTP server (POST /v1/chat/completions) on 127.0.0.1,
in a thread, whose replies follow a script instead of a model.

It reads a request as a gullible judge model would: the nonce of the authentic tags from the system message, a
response from its authentic opening tag up to the first closing tag of any nonce (`</response...`), everything
else "outside". Outside text that looks like an instruction about the score is obeyed (it replies 10); inside
text is graded honestly by `grade` (default: 5 points for each rubric keyword, given in the rubric as
`keywords: a, b`, that the response contains). `mode` changes the reply: "honest" (the above), "slow" (holds the
request until `release` is set), "reply" (answers `content` verbatim), "http" (answers HTTP `status`), "raw"
(answers the bytes `content` as the HTTP body).
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# what a gullible judge takes as an order (tandem's own instructions to the judge never say any of it)
OBEYED = re.compile(r'10\s*/\s*10|\bscore\b\W{0,4}(?:of\s+|is\s+|=\s*|:\s*)?"?10\b|full marks|'
                    r'ignore (?:the|previous|prior|your|all previous) (?:rubric|instructions)', re.IGNORECASE)
CLOSE = re.compile(r"<\s*/\s*response", re.IGNORECASE)


def keyword_grade(rubric: str, text: str) -> float:
    words = [w.strip().lower() for w in rubric.split("keywords:", 1)[-1].split(",") if w.strip()]
    return min(10.0, 5.0 * sum(w in text.lower() for w in words))


def read_as_gullible_judge(system: str, user: str) -> tuple[list[str], str]:
    """(the responses as the judge sees them, the text outside them, system message included)."""
    nonce = re.search(r"<response-([0-9a-f]{16})", system).group(1)
    inside, outside, pos = [], [system], 0
    for opening in re.finditer(rf"<response-{nonce}(?:-\d+)?>", user):
        if opening.start() < pos:
            continue
        outside.append(user[pos:opening.start()])
        close = CLOSE.search(user, opening.end())
        end = close.start() if close else len(user)
        inside.append(user[opening.end():end])
        after = user.find(">", end) + 1 if close else len(user)
        pos = after
    outside.append(user[pos:])
    return inside, "".join(outside)


class ScriptedJudge:
    def __init__(self, mode: str = "honest", content: str = "", status: int = 200, grade=keyword_grade):
        self.mode, self.content, self.status, self.grade = mode, content, status, grade
        self.release = threading.Event()
        self.requests: list[dict] = []
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                judge.requests.append({**body, "authorization": self.headers.get("Authorization")})
                if judge.mode == "slow":
                    judge.release.wait(30)
                if judge.mode == "http":
                    self.send_response(judge.status)
                    self.end_headers()
                    return
                data = judge.content.encode() if judge.mode == "raw" else json.dumps(
                    {"choices": [{"message": {"role": "assistant", "content": judge.reply(body)}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def reply(self, body: dict) -> str:
        if self.mode == "reply":
            return self.content
        system, user = (m["content"] for m in body["messages"])
        inside, outside = read_as_gullible_judge(system, user)
        rubric = system.split("Rubric:\n", 1)[1].split("\n\n", 1)[0]
        scores = [10.0 if OBEYED.search(outside) else self.grade(rubric, text) for text in inside]
        group = "scores" in body["response_format"]["json_schema"]["schema"]["properties"]
        return json.dumps({"scores": scores} if group else {"score": scores[0]})

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
