"""Adapter for GEM (pip gem-llm==0.1.0, "A Gym for Generalist LLMs"): `--taskset gem:ENV_ID[,ENV_ID]`, e.g.
gem:game:GuessTheNumber-v0-easy (GEM's games, math and QA environments, by their registry ids). GEM's own
text is the observation (with the hint it returns in info["suffix"]), its reward the step reward, and an episode
ends when GEM says terminated or truncated.

gem-llm 0.1.0 pins reasoning-gym==0.1.23 and nltk==3.9.1, older than this project's pins, so it is not in
requirements.txt: install it beside them with `pip install --no-deps gem-llm==0.1.0` (its games and math
environments import with the versions pinned here; environments that need more, e.g. its search tools, need
their own extras). Without it, a gem taskset is refused with one line when it is built.
"""

from __future__ import annotations

from common.envs import Env, StepResult


def gem_ids(arg: str | None) -> list[str]:
    ids = [i for i in (arg or "").split(",") if i]
    if not ids:
        raise SystemExit("error: --taskset gem:ENV_ID[,ENV_ID]: name at least one GEM environment id")
    try:
        from gem.envs.registration import ENV_REGISTRY
    except ImportError as e:
        raise SystemExit(f"error: --taskset gem:{arg}: GEM is not importable ({e}); pip install --no-deps "
                         "gem-llm==0.1.0") from None
    for env_id in ids:
        if env_id not in ENV_REGISTRY:
            raise SystemExit(f"error: --taskset gem:{env_id}: no such GEM environment")
    return ids


def gem_task(rng, index: int, difficulty: int, arg: str | None = None) -> dict:
    ids = gem_ids(arg)
    return {"id": f"gem-{ids[index % len(ids)]}-{index}", "env": "gem", "gem_env": ids[index % len(ids)],
            "seed": rng.randint(0, 2**31 - 1)}


def observation(text, info: dict) -> str:
    suffix = info.get("suffix") if isinstance(info, dict) else None
    return f"{text}\n{suffix}" if suffix else str(text)


class Gem(Env):
    required_fields = ("gem_env",)
    worst_reward = -1.0  # GEM does not declare a floor; its games' penalties are assumed to be no lower
    make_task = staticmethod(gem_task)

    def reset(self, task: dict) -> list[dict]:
        import gem

        self.env = gem.make(task["gem_env"])
        text, info = self.env.reset(seed=int(task.get("seed", 0)))
        return [{"role": "user", "content": observation(text, info)}]

    def step(self, action: str) -> StepResult:
        text, reward, terminated, truncated, info = self.env.step(action)
        done = bool(terminated or truncated)
        messages = [] if done else [{"role": "user", "content": observation(text, info)}]
        return StepResult(messages, float(reward), done, {"truncated": bool(truncated)})
