"""Tool-call arguments the model writes as a JSON object, streamed as they are generated.

`JsonArgs` checks the text character by character and hands out the longest prefix that can
still become valid JSON by appending closers alone (a quote, brackets, braces): inside a string
value every character is such a point, so long string arguments stream as they come. The object's
end is found by its own braces, so text after it (a wrapper's `}`, a code fence) is left over.
At the end of the call `close` says what the arguments were: "complete" (passed on as written;
a raw control character inside a string, as models write newlines in code, is escaped),
"repaired" (only closing brackets and braces were missing: the text ends after a complete value,
a number counting as complete, or right after an opening bracket, or there was no text at all,
read as `{}`; the closers are appended, which changes no value) or "broken" (a string or literal
cut off, a dangling key, colon or comma, a syntax error): the parser then returns the call as
content (base.py). `committed` says when the first argument bytes are known to start an object,
so the parser can announce the call.
"""

from __future__ import annotations

import json
import re

_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_CLOSE = {"{": "}", "[": "]"}


class JsonArgs:
    def __init__(self) -> None:
        self.text = ""  # characters accepted so far (leading whitespace skipped)
        self.emitted = 0
        self.safe = 0  # longest prefix closable by closers alone
        self.safe_closers = "{}"  # what closes text[:safe] (before '{' arrives: the empty object)
        self.stack: list[str] = []
        self.state = "start"
        self.literal = ""  # the rest of a true/false/null being read
        self.number = ""
        self.unicode = 0  # hex digits left in a \\u escape
        self.done = False
        self.error = False
        self.rest = ""  # what followed the object
        self._solid = 0  # non-whitespace characters accepted (up to 2)

    # -- the scanner --------------------------------------------------------------------------

    def push(self, text: str) -> str:
        """Accept `text`; return the newly safe fragment."""
        for i, ch in enumerate(text):
            if self.done or self.error:
                self.rest += text[i:]
                break
            if self.state == "start" and ch in " \t\r\n":
                continue  # whitespace before the object is not part of the arguments
            if self.state in ("str", "key") and not self.unicode and ch < " ":
                # a raw control character inside a string (models write raw newlines in code):
                # unambiguous, so repaired to its escape
                self.text += json.dumps(ch)[1:-1]
                self._mark()
                continue
            if not self._char(ch):
                self.error = True
                self.rest += text[i:]
                break
            self.text += ch
            if self._solid < 2 and ch not in " \t\r\n":
                self._solid += 1
            self._mark()
        return self._take()

    @property
    def committed(self) -> bool:
        """Whether the text begins an object past its opening brace (`{"` or `{}`)."""
        return self.done or (not self.error and self._solid >= 2)

    @property
    def status(self) -> str:
        """ "complete", "repaired" (closers alone make it whole) or "broken"."""
        if self.done:
            return "complete"
        if self.error:
            return "broken"
        if self.state in ("start", "after", "obj_first", "arr_first"):
            return "repaired"
        if self.state == "num" and _NUMBER.fullmatch(self.number):
            return "repaired"
        return "broken"

    def close(self) -> tuple[str, str]:
        """(the last fragment, `status`): for "complete" and "repaired" the fragment completes
        valid JSON; for "broken" it closes what was handed out at the last valid point (for a
        caller that must still end the JSON it streamed)."""
        status = self.status
        if status == "complete":
            return self._take(), status
        fragment = self.text[self.emitted : self.safe] + self.safe_closers
        self.emitted = len(self.text)
        return fragment, status

    def _take(self) -> str:
        out = self.text[self.emitted : self.safe]
        self.emitted = max(self.emitted, self.safe)
        return out

    def _closers(self) -> str:
        return "".join(_CLOSE[c] for c in reversed(self.stack))

    def _mark(self) -> None:
        state = self.state
        if self.done:
            self.safe, self.safe_closers = len(self.text), ""
        elif state in ("after", "obj_first", "arr_first"):
            self.safe, self.safe_closers = len(self.text), self._closers()
        elif state == "str" and self.unicode == 0:
            self.safe, self.safe_closers = len(self.text), '"' + self._closers()
        elif state == "num" and _NUMBER.fullmatch(self.number):
            self.safe, self.safe_closers = len(self.text), self._closers()

    def _value_start(self, ch: str) -> bool:
        if ch == "{":
            self.stack.append("{")
            self.state = "obj_first"
        elif ch == "[":
            self.stack.append("[")
            self.state = "arr_first"
        elif ch == '"':
            self.state = "str"
        elif ch in "-0123456789":
            self.state, self.number = "num", ch
        elif ch in "tfn":
            self.state = "lit"
            self.literal = {"t": "rue", "f": "alse", "n": "ull"}[ch]
        else:
            return False
        return True

    def _after_value(self) -> None:
        self.state = "after"
        if not self.stack:
            self.done = True

    def _char(self, ch: str) -> bool:  # noqa: C901 (one state machine)
        state = self.state
        space = ch in " \t\r\n"
        if state == "start":
            if space:
                return True
            if ch != "{":
                return False
            self.stack.append("{")
            self.state = "obj_first"
            return True
        if state == "str":
            if self.unicode:
                if ch not in "0123456789abcdefABCDEF":
                    return False
                self.unicode -= 1
            elif ch == "\\":
                self.state = "str_esc"
            elif ch == '"':
                self._after_value()
            elif ch < " ":
                return False
            return True
        if state == "str_esc":
            if ch == "u":
                self.unicode = 4
            elif ch not in '"\\/bfnrt':
                return False
            self.state = "str"
            return True
        if state in ("key", "key_esc"):
            if state == "key_esc":
                self.state = "key"
            elif ch == "\\":
                self.state = "key_esc"
            elif ch == '"':
                self.state = "colon"
            elif ch < " ":
                return False
            return True
        if state == "num":
            if ch in "0123456789+-.eE":
                self.number += ch
                return True
            if not _NUMBER.fullmatch(self.number):
                return False
            self._after_value()
            return self._char(ch)
        if state == "lit":
            if not self.literal or ch != self.literal[0]:
                return False
            self.literal = self.literal[1:]
            if not self.literal:
                self._after_value()
            return True
        if space:
            return True
        if state in ("obj_first", "obj_key"):
            if ch == '"':
                self.state = "key"
                return True
            if ch == "}" and state == "obj_first":
                self.stack.pop()
                self._after_value()
                return True
            return False
        if state == "colon":
            if ch != ":":
                return False
            self.state = "value"
            return True
        if state in ("value", "arr_first"):
            if ch == "]" and state == "arr_first":
                self.stack.pop()
                self._after_value()
                return True
            return self._value_start(ch)
        if state == "after":
            top = self.stack[-1]
            if ch == ",":
                self.state = "obj_key" if top == "{" else "value"
                return True
            if ch == _CLOSE[top]:
                self.stack.pop()
                self._after_value()
                return True
            return False
        return False
