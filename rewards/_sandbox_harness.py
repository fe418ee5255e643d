"""Test harness of a sandbox run with a judge (rewards.sandbox.run(..., harness=...)); loaded by the launcher.

Two processes inside the sandbox, with different uids (as root) and the judge non-dumpable:
- the candidate process runs the program (the model's definitions) as __main__, then `serve`s calls: it reads
  `[args, kwargs]` lines from the judge and answers each with the entry point's return value, encoded as plain
  data. It never sees the tests, the expected values, the verdict channel or the nonce.
- the judge process reads the test spec (prompt, test code, entry point, nonce) from a memfd that only it holds,
  runs the prompt (for its helper functions) and the test's `check(candidate)` where `candidate` is a proxy that
  forwards each call to the candidate process and decodes the answer strictly (`decode`: only exact builtin types
  come out, so no object of the candidate's can reach an `==`). Any error while handling the candidate's answer
  is its failure (`Proxy`), and an exception the test's own code catches fails the verdict (`CaughtInTest`).
  The verdict, with the nonce, goes to a pipe that only the judge holds and that the caller reads.
stdlib only; imported before the sandbox's file system is set up.
"""

import json
import os
import sys

MAX_LINE = 16 << 20  # the longest answer the judge reads (bytes)
PLAIN = (type(None), bool, int, float, str)


# ---------------------------------------------------------------- plain data, both directions
def to_tree(value, depth=0):
    """Exact builtin types only (a subclass of int with its own __eq__ is not an int here) -> JSON-able tree.
    Containers are tagged so that a list, a tuple, a set and a dict stay apart."""
    if depth > 100:
        raise TypeError("value nested deeper than 100")
    kind = type(value)
    if kind in PLAIN:
        return value
    if kind is list:
        return {"l": [to_tree(v, depth + 1) for v in value]}
    if kind is tuple:
        return {"t": [to_tree(v, depth + 1) for v in value]}
    if kind in (set, frozenset):
        return {"s" if kind is set else "f": [to_tree(v, depth + 1) for v in value]}
    if kind is dict:
        return {"d": [[to_tree(k, depth + 1), to_tree(v, depth + 1)] for k, v in value.items()]}
    if kind is bytes:
        return {"b": value.hex()}
    if kind is complex:
        return {"c": [value.real, value.imag]}
    raise TypeError(f"not plain data: {kind.__module__}.{kind.__qualname__}")


def from_tree(tree, depth=0):
    """The strict inverse of `to_tree`: anything else (an unknown tag, extra keys) is an error."""
    if depth > 100:
        raise ValueError("value nested deeper than 100")
    kind = type(tree)
    if kind in PLAIN:
        return tree
    if kind is not dict or len(tree) != 1:
        raise ValueError(f"malformed value of type {kind.__name__}")
    (tag, body), = tree.items()
    if tag in "ltsf" and type(body) is list:
        items = [from_tree(v, depth + 1) for v in body]
        return {"l": list, "t": tuple, "s": set, "f": frozenset}[tag](items)
    if tag == "d" and type(body) is list and all(type(p) is list and len(p) == 2 for p in body):
        return {from_tree(k, depth + 1): from_tree(v, depth + 1) for k, v in body}
    if tag == "b" and type(body) is str:
        return bytes.fromhex(body)
    if tag == "c" and type(body) is list and len(body) == 2 and all(type(x) in (int, float) for x in body):
        return complex(*body)
    raise ValueError(f"malformed value with tag {str(tag)[:20]!r}")


def encode(value) -> bytes:
    return json.dumps(to_tree(value)).encode() + b"\n"


def decode(line: bytes):
    return from_tree(json.loads(line))


class LineReader:
    def __init__(self, fd):
        self.fd, self.buf = fd, b""

    def readline(self) -> bytes:
        while b"\n" not in self.buf:
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                raise EOFError("the other side closed the pipe")
            self.buf += chunk
            if len(self.buf) > MAX_LINE:
                raise ValueError(f"message longer than {MAX_LINE} bytes")
        line, _, self.buf = self.buf.partition(b"\n")
        return line


def write_all(fd, data: bytes):
    while data:
        data = data[os.write(fd, data):]


# ---------------------------------------------------------------- candidate side (untrusted afterwards)
def serve(namespace: dict, entry_point: str, req_fd: int, resp_fd: int):
    """Answer the judge's calls until it closes the pipe. Runs after the program's own code, in its process: it
    can be replaced or tampered with, which gains nothing, since the judge trusts only the decoded values."""
    reader = LineReader(req_fd)
    while True:
        try:
            args, kwargs = decode(reader.readline())
        except EOFError:
            return
        try:
            reply = {"ok": to_tree(namespace[entry_point](*args, **kwargs))}
        except Exception as e:  # noqa: BLE001 - the candidate's error is the answer, reported to the judge
            reply = {"raise": f"{type(e).__name__}: {str(e)[:200]}"}
        write_all(resp_fd, json.dumps(reply).encode() + b"\n")


# ---------------------------------------------------------------- judge side (trusted)
class CandidateError(BaseException):
    """The candidate raised, answered with something that is not plain data, or went away. A BaseException, so
    that a test's own `except Exception` cannot swallow it."""


class Proxy:
    """The candidate as the test sees it. Everything between the test's call and the value it gets back (encoding
    the arguments, the pipe, parsing and decoding the answer) runs on data the candidate can shape, so any error
    there, whatever its type (TypeError of an unhashable key, OverflowError of a huge complex, RecursionError of
    deep nesting, MemoryError), is the candidate's failure: a CandidateError, which a test cannot catch."""

    def __init__(self, name, req_fd, resp_fd):
        self.__name__ = name
        self.req_fd, self.reader, self.calls = req_fd, LineReader(resp_fd), 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        try:
            return self._call(args, kwargs)
        except CandidateError:
            raise
        except (OSError, EOFError) as e:
            raise CandidateError(f"candidate process gone: {e}") from None
        except Exception as e:  # noqa: BLE001 - see the class docstring
            raise CandidateError(f"unreadable answer: {type(e).__name__}: {str(e)[:120]}") from None

    def _call(self, args, kwargs):
        write_all(self.req_fd, encode([list(args), kwargs]))
        reply = json.loads(self.reader.readline())
        if type(reply) is not dict or len(reply) != 1:
            raise CandidateError("malformed answer")
        if "raise" in reply:
            raise CandidateError(f"candidate raised {str(reply['raise'])[:200]}")
        if "ok" not in reply:
            raise CandidateError("malformed answer")
        return from_tree(reply["ok"])


def read_spec(fd: int) -> dict:
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return json.loads(b"".join(chunks))


def compile_prompt(prompt: str):
    """The prompt for its imports and helpers; a prompt that ends in a bare `def` line gets a `pass` body."""
    try:
        return compile(prompt, "prompt.py", "exec")
    except SyntaxError:
        return compile(prompt.rstrip() + "\n    pass\n", "prompt.py", "exec")


class CaughtInTest:
    """A trace function that notes every exception raised in (or passing through) the test's own frames. A test
    that swallows an exception did not see the candidate pass: it skipped an input (`except Exception: continue`)
    or caught the CandidateError that stood for the candidate's failure. Honest HumanEval tests never do this."""

    def __init__(self):
        self.first: str | None = None

    def __call__(self, frame, event, arg):
        if event == "call" and frame.f_code.co_filename == "test.py":
            return self.local
        return None

    def local(self, frame, event, arg):
        if event == "exception" and self.first is None:
            self.first = f"{arg[0].__name__}: {str(arg[1])[:160]}"
        return self.local


def judge(spec: dict, req_fd: int, resp_fd: int) -> dict:
    """Run the test's `check(candidate)` against the proxy. -> {"passed": bool, "reason": str, "calls": int}."""
    proxy = Proxy(spec["entry_point"], req_fd, resp_fd)
    env = {"__name__": "__judge__"}
    caught = CaughtInTest()
    try:
        exec(compile_prompt(spec["prompt"]), env)  # noqa: S102 - the task's own helpers
        env[spec["entry_point"]] = proxy
        exec(compile(spec["test"], "test.py", "exec"), env)  # noqa: S102
        sys.settrace(caught)
        try:
            env["check"](proxy)
        finally:
            sys.settrace(None)
    except CandidateError as e:
        return {"passed": False, "reason": str(e), "calls": proxy.calls}
    except AssertionError as e:
        return {"passed": False, "reason": f"AssertionError {str(e)[:200]}".strip(), "calls": proxy.calls}
    except Exception as e:  # noqa: BLE001 - any failure of the test is a failed test
        return {"passed": False, "reason": f"{type(e).__name__}: {str(e)[:200]}", "calls": proxy.calls}
    if caught.first is not None:
        return {"passed": False, "reason": f"the test caught {caught.first}", "calls": proxy.calls}
    if proxy.calls == 0:
        return {"passed": False, "reason": "the test never called the candidate", "calls": 0}
    return {"passed": True, "reason": "passed", "calls": proxy.calls}
