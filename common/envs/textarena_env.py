"""Adapter for TextArena (pip textarena==0.7.4) single-player games, offline: `--taskset textarena:GAME[,GAME]`,
e.g. textarena:GuessTheNumber-v0 (also checked: Mastermind-v0, TowerOfHanoi-v0; Wordle and Hangman need NLTK
downloads). The game's own text is the observation (only what is new since the last turn, minus the echo of the
player's move), and the reward is the library's own: `env.close()`'s reward of player 0 at the end of the game."""

from __future__ import annotations

from common.envs import Env, StepResult


def textarena_task(game: str, seed: int, index: int) -> dict:
    return {"id": f"textarena-{game}-{index}", "env": "textarena", "game": game, "seed": seed}


class TextArena(Env):
    required_fields = ("game",)

    def reset(self, task: dict) -> list[dict]:
        import textarena as ta

        self.env = ta.make(task["game"])
        self.env.reset(num_players=1, seed=int(task.get("seed", 0)))
        _, observation = self.env.get_observation()
        self.seen = observation
        return [{"role": "user", "content": observation.strip()}]

    def step(self, action: str) -> StepResult:
        done, info = self.env.step(action)
        if done:
            rewards, game_info = self.env.close()
            reward = float(rewards[0]) if rewards else 0.0
            return StepResult([], reward, True, {"success": reward > 0, "game": dict(game_info.get(0, {}))})
        _, observation = self.env.get_observation()
        new = observation[len(self.seen):] if observation.startswith(self.seen) else observation
        self.seen = observation
        lines = [l for l in new.strip().splitlines() if not l.startswith("[Player]")]  # the echo of our move
        return StepResult([{"role": "user", "content": "\n".join(lines).strip() or "Continue."}], 0.0, False,
                          dict(info or {}))
