"""Adapter for TextArena (pip textarena==0.7.4) single-player games, offline: `--taskset textarena:GAME[,GAME]`,
e.g. textarena:GuessTheNumber-v0 (also checked: Mastermind-v0, TowerOfHanoi-v0). Games whose code reads NLTK's
corpora (Wordle, Hangman, WordLadder, ...: their modules call nltk.download at import) are refused when the
taskset is built, in one line, unless NLTK's 'words' corpus is installed (NLTK_DATA): no package on PyPI ships
it, and offline the download would fail inside the run. The game's own text is the observation (only what is new
since the last turn, minus the echo of the player's move).

The reward is the library's own (`env.close()`'s reward of player 0 at the end of the game) for a game that ended
by valid play: 1 for a win, and the game's own measure of progress when it ran out of turns. A game that ended on
an invalid move pays nothing (a penalty the library gives, below 0, stays): some games (GuessTheNumber) grant the
closeness of the last valid guess there, so repeating an invalid move would end the game on a partial reward on
purpose. A task with `partial_credit: true` (the `env_partial_credit` task processor) gets the library's reward
as is. `success` means solved: the library's win reward (>= 1) after valid play."""

from __future__ import annotations

from common.envs import Env, StepResult


def games_of(arg: str | None) -> list[str]:
    """The games of `textarena:GAME[,GAME]`, each checked: known to TextArena, and its NLTK data present if its
    code needs some (a one-line SystemExit otherwise)."""
    import importlib.util

    from textarena.envs.registration import ENV_REGISTRY

    games = [g for g in (arg or "").split(",") if g]
    if not games:
        raise SystemExit("error: --taskset textarena:GAME[,GAME]: name at least one game (e.g. GuessTheNumber-v0)")
    for game in games:
        if game not in ENV_REGISTRY:
            raise SystemExit(f"error: --taskset textarena:{game}: no such TextArena game")
        module = ENV_REGISTRY[game].entry_point.split(":")[0] if isinstance(ENV_REGISTRY[game].entry_point, str) \
            else None
        spec = importlib.util.find_spec(module) if module else None
        source = open(spec.origin).read() if spec and spec.origin else ""
        if ("nltk" in source or "word_lists" in source) and not nltk_words_installed():
            raise SystemExit(f"error: --taskset textarena:{game}: the game needs NLTK's 'words' corpus, which is not "
                             f"installed (no network to download it; set NLTK_DATA to a copy, or pick a game "
                             f"such as GuessTheNumber-v0)")
    return games


def nltk_words_installed() -> bool:
    try:
        import nltk

        nltk.data.find("corpora/words")
        return True
    except (ImportError, LookupError):
        return False


def make_textarena_task(rng, index: int, difficulty: int, arg: str | None = None) -> dict:
    games = games_of(arg)
    game = games[index % len(games)]
    return {"id": f"textarena-{game}-{index}", "env": "textarena", "game": game, "seed": rng.randint(0, 2**31 - 1)}


def end_reward(library_reward: float, invalid_move: bool, partial_credit: bool) -> tuple[float, dict]:
    """(reward, info) of a finished game from the library's reward (see the module docstring)."""
    solved = library_reward >= 1.0 and not invalid_move
    reward = min(library_reward, 0.0) if invalid_move and not partial_credit else library_reward
    return reward, {"success": solved, "invalid_move": invalid_move, "library_reward": library_reward}


class TextArena(Env):
    required_fields = ("game",)
    worst_reward = -1.0  # the library's invalid-move penalty (textarena.state.State.set_invalid_move)
    make_task = staticmethod(make_textarena_task)

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
