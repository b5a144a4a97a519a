"""The interactive chat of `mlxcel chat` / `mlxcel run`: a banner, slash commands, line editing
and history, and Ctrl-C that stops an answer without ending the conversation.

Input is read with `input()` on the main thread, so on a terminal GNU readline gives line
editing and a history kept across sessions (`chat_history` beside the model store, or
MLXCEL_CACHE_DIR). Each answer streams in its own event loop: a Ctrl-C while it streams cancels
that loop's task, the engine row is cancelled with it, and the words already shown stay in the
conversation as the assistant's turn. A Ctrl-C at the prompt clears the line; Ctrl-D or /exit
leaves.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path

from mlxcel.cli.generate_cmds import chat_prompt, stream_tokens
from mlxcel.config.paths import user_cache_dir

PROMPT = ">>> "
HELP = """\
  /help          this list
  /exit, /bye    leave (Ctrl-D too)
  /clear         forget the conversation (the system message stays)
  /system TEXT   set the system message; /system alone shows it, /system - removes it
  Ctrl-C         stop the answer being written (what it said so far stays in the conversation)
"""


def history_file() -> Path:
    return user_cache_dir(os.environ) / "chat_history"


def _enable_line_editing() -> Callable[[], None]:
    """readline for input(): editing, and history across sessions; returns what saves the
    history. Terminals only (imported on a pipe it may write control sequences into the output)."""
    if not sys.stdin.isatty():
        return lambda: None
    try:
        import readline
    except ImportError:  # Windows without pyreadline: plain input()
        return lambda: None
    path = history_file()
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(1000)

    def save() -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)
        except OSError:
            pass

    return save  # called after each line: the chat leaves through os._exit, past any atexit hook


class ChatSession:
    def __init__(self, model, max_tokens: int, system: str | None, name: str, out=sys.stdout) -> None:
        self.model, self.max_tokens, self.system, self.name, self.out = model, max_tokens, system, name, out
        self.turns: list[dict] = []

    def messages(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns

    def banner(self) -> str:
        info = self.model.info
        template = "its chat template" if self.model.tokenizer.chat_template else "no chat template (plain text)"
        return (f"mlxcel chat: {self.name} ({info.model_type}, {info.backend} on {info.device}, "
                f"context {self.model.n_ctx} tokens, {template})\n"
                "Type a message, /help for commands, /exit or Ctrl-D to leave.")

    def command(self, line: str) -> bool:
        """Run a slash command; False when it ends the chat."""
        name, _, rest = line.partition(" ")
        rest = rest.strip()
        if name in ("/exit", "/quit", "/bye"):
            return False
        if name in ("/help", "/?"):
            self.out.write(HELP)
        elif name == "/clear":
            n = len(self.turns)
            self.turns.clear()
            print(f"conversation cleared ({n} messages)", file=self.out)
        elif name == "/system":
            if rest == "-":
                self.system = None
                print("system message removed", file=self.out)
            elif rest:
                self.system = rest
                print("system message set", file=self.out)
            else:
                print(f"system message: {self.system!r}" if self.system else "no system message", file=self.out)
        else:
            print(f"unknown command {name}; /help lists them", file=self.out)
        return True

    def answer(self, text: str) -> None:
        self.turns.append({"role": "user", "content": text})
        parts: list[str] = []

        class Tee:  # what was shown is what the conversation keeps, even when interrupted
            def write(_, s: str) -> None:
                parts.append(s)
                self.out.write(s)

            def flush(_) -> None:
                self.out.flush()

        try:
            asyncio.run(stream_tokens(self.model, chat_prompt(self.model, self.messages()), self.max_tokens,
                                      out=Tee()))
        except KeyboardInterrupt:
            print("\n(stopped)", end="", file=self.out)
        print(file=self.out)
        self.turns.append({"role": "assistant", "content": "".join(parts)})

    def loop(self) -> None:
        save_history = _enable_line_editing()
        print(self.banner(), file=self.out)
        while True:
            try:
                line = input(PROMPT)
            except EOFError:
                print(file=self.out)
                return
            except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
                print("\n(Ctrl-D or /exit leaves)", file=self.out)
                continue
            line = line.strip()
            if not line:
                continue
            save_history()
            if line.startswith("/"):
                if not self.command(line):
                    return
                continue
            self.answer(line)
