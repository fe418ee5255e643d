"""Adapter for TextArena (pip textarena==0.7.4) single-player games, offline: `--taskset textarena:GAME[,GAME]`,
e.g. textarena:GuessTheNumber-v0 (also checked: Mastermind-v0, TowerOfHanoi-v0; Wordle and Hangman need NLTK
downloads). The game's own text is the observation (only what is new since the last turn, minus the echo of the
player's move).

The reward is the library's own (`env.close()`'s reward of player 0 at the end of the game) for a game that ended
by valid play: 1 for a win, and the game's own measure of progress when it ran out of turns. A game that ended on
an invalid move pays nothing (a penalty the library gives, below 0, stays): some games (GuessTheNumber) grant the
closeness of the last valid guess there, so repeating an invalid move would end the game on a partial reward on
purpose. A task with `partial_credit: true` (the `env_partial_credit` task processor) gets the library's reward
as is. `success` means solved: the library's win reward (>= 1) after valid play."""

from __future__ import annotations

from common.envs import Env, StepResult


def textarena_task(game: str, seed: int, index: int) -> dict:
    return {"id": f"textarena-{game}-{index}", "env": "textarena", "game": game, "seed": seed}


def end_reward(library_reward: float, invalid_move: bool, partial_credit: bool) -> tuple[float, dict]:
    """(reward, info) of a finished game from the library's reward (see the module docstring)."""
    solved = library_reward >= 1.0 and not invalid_move
    if invalid_move and not partial_credit:
        reward = min(library_reward, 0.0)
    else:
        reward = library_reward
    return reward, {"success": solved, "invalid_move": invalid_move, "library_reward": library_reward}


class TextArena(Env):
    required_fields = ("game",)

    def reset(self, task: dict) -> list[dict]:
        import textarena as ta

        self.partial_credit = bool(task.get("partial_credit", False))
        self.env = ta.make(task["game"])
        self.env.reset(num_players=1, seed=int(task.get("seed", 0)))
        _, observation = self.env.get_observation()
        self.seen = observation
        return [{"role": "user", "content": observation.strip()}]

    def step(self, action: str) -> StepResult:
        done, info = self.env.step(action)
        if done:
            rewards, game_info = self.env.close()
            game = dict(game_info.get(0, {}))
            reward, end = end_reward(float(rewards[0]) if rewards else 0.0, bool(game.get("invalid_move")),
                                     self.partial_credit)
            return StepResult([], reward, True, {**end, "game": game})
        _, observation = self.env.get_observation()
        new = observation[len(self.seen):] if observation.startswith(self.seen) else observation
        self.seen = observation
        lines = [l for l in new.strip().splitlines() if not l.startswith("[Player]")]  # the echo of our move
        return StepResult([{"role": "user", "content": "\n".join(lines).strip() or "Continue."}], 0.0, False,
                          dict(info or {}))
