"""The shell commands of a markdown page's ``bash`` blocks, as a reader would paste them one at a time.

A command is the text up to a line end that closes every quote and is not continued by a trailing
backslash (the serving page's ``curl -d '{...}'`` spans four lines inside one quote). Its trailing
``# ...`` comment is kept apart (it often promises the output: ``# prints: ready ...``), and a
``# -> ...`` line right after it is the output the page promises for it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass
class Command:
  page: str  # the page as given (e.g. "README.md")
  line: int  # 1-based line of the command's first line
  text: str  # the command exactly as written, comments and line continuations included
  args: List[str]  # its shell words, comments dropped
  comment: str = ""  # the trailing comment of its last line, without '#'
  expect: Optional[str] = None  # the '# -> ...' line after it, without '# ->'

  @property
  def where(self) -> str:
    return f"{self.page}:{self.line}"


def _closed(text: str) -> bool:
  """Whether ``text`` is whole shell words (no quote left open)."""
  try:
    shlex.split(text, comments=True)
  except ValueError:
    return False
  return True


def _comment(cmd: str) -> str:
  """The last comment of a command: from a '#' that starts a word outside quotes to its line's end."""
  quote, found, i = "", "", 0
  while i < len(cmd):
    c = cmd[i]
    if quote:
      if c == "\\" and quote == '"':
        i += 1
      elif c == quote:
        quote = ""
    elif c == "\\":
      i += 1
    elif c in "'\"":
      quote = c
    elif c == "#" and (i == 0 or cmd[i - 1].isspace()):
      end = cmd.find("\n", i)
      end = len(cmd) if end < 0 else end
      found, i = cmd[i + 1 : end].strip(), end
      continue
    i += 1
  return found


def bash_commands(text: str, page: str = "") -> List[Command]:
  """Every command of ``text``'s ```bash / ```sh blocks, in order."""
  out: List[Command] = []
  lines = text.splitlines()
  in_bash, i = False, 0
  while i < len(lines):
    line = lines[i]
    if line.startswith("```"):
      in_bash = line.strip() in ("```bash", "```sh")
      i += 1
      continue
    if not in_bash or not line.strip():
      i += 1
      continue
    if line.lstrip().startswith("#"):
      m = re.match(r"\s*#\s*->\s*(.*)", line)
      if m and out and out[-1].page == page:
        out[-1].expect = m.group(1).strip()
      i += 1
      continue
    start, cmd = i, line
    while (
      (cmd.rstrip().endswith("\\") or not _closed(cmd)) and i + 1 < len(lines) and not lines[i + 1].startswith("```")
    ):
      i += 1
      cmd += "\n" + lines[i]
    out.append(Command(page, start + 1, cmd, shlex.split(cmd.replace("\\\n", " "), comments=True), _comment(cmd)))
    i += 1
  return out


def page_commands(page: str) -> List[Command]:
  """:func:`bash_commands` of a page of this checkout (a path relative to the repository root)."""
  with open(os.path.join(ROOT, page), encoding="utf-8") as f:
    return bash_commands(f.read(), page)
