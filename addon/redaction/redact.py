"""Response redaction: a stamped secret echoed by the upstream reaches the agent as [REDACTED].

Each form of a secret (as sent, and its base64 forms) is matched however it is escaped: every
byte may appear literally, percent-encoded with either hex case (`+` for a space), as a JSON
escape (`\\u00hh`, `\\/`, `\\"` ...) or as an HTML/XML character reference (`&#39;`,
`&#x27;`, `&amp;`, `&plus;` ...), each byte independently.

A body is first sieved: an encoded form holds either a form's text whole or at least one
escape of one of its bytes. One multi-literal search (ahocorasick_rs: the Rust aho-corasick
crate's vectorised search, a fraction of a nanosecond per byte) finds the texts and the first
two bytes of every escape; each of those is then checked to be an escape. Only the
neighbourhood of what the sieve finds is searched with the full pattern, and only a hit there
makes the whole body go through it. Text dense with escape starts (URL-encoded text, say) is
sieved by a second finder of whole escapes, each kept only between encodings of the bytes that
may precede and follow its byte in a form.

One module, about 580 lines: the patterns, the sieve and the streaming state are one
mechanism, tested together against the full pattern (a split would separate the sieve from
the proof that it hides nothing).
"""

from __future__ import annotations

import base64
import functools
import re
import zlib
from collections.abc import Callable, Sequence
from html.entities import html5

import ahocorasick_rs

MARK = b"[REDACTED]"
# Re-matching after a substitution ends within a few passes unless a form lives inside MARK.
MAX_PASSES = 8
# Bytes of a form the regex before the exact walk of a stream's tail reads (Redactor.partial).
HEADS = 4
_JSON_SHORT = {0x22: b'\\"', 0x5C: b"\\\\", 0x2F: b"\\/", 8: b"\\b", 12: b"\\f", 10: b"\\n"}
_JSON_SHORT |= {13: b"\\r", 9: b"\\t"}


def _named() -> dict[int, tuple[bytes, ...]]:
    """HTML5's named character references of ASCII bytes, from the standard library's table:
    `&amp;` and `&AMP;`, and those an HTML5 serializer may write for base64's `+`, `/` and `=`
    (`&plus;`, `&sol;`, `&equals;`), `&lowbar;`, `&DiacriticalGrave;` ..."""
    named: dict[int, list[bytes]] = {}
    for name, char in sorted(html5.items()):
        if name.endswith(";") and len(char) == 1 and ord(char) < 0x80:
            named.setdefault(ord(char), []).append(b"&" + name.encode("ascii"))
    return {byte: tuple(names) for byte, names in named.items()}


_NAMED = _named()


class Unredactable(ValueError):
    """Substitution did not converge: MARK itself holds a form of the secret."""


def forms(secret: bytes) -> list[bytes]:
    """The secret as sent and base64 (both alphabets, with and without padding)."""
    candidates = {
        secret,
        base64.b64encode(secret),
        base64.b64encode(secret).rstrip(b"="),
        base64.urlsafe_b64encode(secret),
        base64.urlsafe_b64encode(secret).rstrip(b"="),
    }
    return sorted((c for c in candidates if len(c) >= 4), key=len, reverse=True)


def _hex_cases(byte: int) -> list[bytes]:
    """Two hex digits of `byte`, each digit in either case."""
    digits = b"%02x" % byte
    hi, lo = ({d, ord(chr(d).upper())} for d in digits)
    return sorted({bytes((h, low)) for h in hi for low in lo})


@functools.cache
def encodings(byte: int) -> tuple[bytes, ...]:
    """Every way one byte of a form may be written in a response."""
    out = [bytes((byte,))] + [b"%" + h for h in _hex_cases(byte)]
    if byte == 0x20:
        out.append(b"+")
    if byte < 0x80:  # JSON escapes code points; above ASCII they are not single bytes
        out += [b"\\u00" + h for h in _hex_cases(byte)]
        if byte in _JSON_SHORT:
            out.append(_JSON_SHORT[byte])
        out += _references(byte)
    return tuple(out)


def _references(byte: int) -> list[bytes]:
    """HTML/XML character references of an ASCII byte: decimal and hex (`x` or `X`, digits
    in either case), unpadded or zero-padded as serializers write them (`&#39;`, `&#039;`,
    `&#x27;`, `&#x0027;`), and the named ones (`&amp;`, `&quot;` ...)."""
    decimal = {b"%d" % byte, b"%03d" % byte, b"%04d" % byte}
    hexes: set[bytes] = set()
    for digits in {b"%x" % byte, b"%02x" % byte, b"%04x" % byte}:
        cases = [{d, ord(chr(d).upper())} for d in digits]
        variants = [b""]
        for options in cases:
            variants = [v + bytes((c,)) for v in variants for c in sorted(options)]
        hexes.update(variants)
    out = [b"&#" + d + b";" for d in sorted(decimal)]
    out += [b"&#" + x + h + b";" for x in (b"x", b"X") for h in sorted(hexes)]
    return out + list(_NAMED.get(byte, ()))


@functools.cache
def _unit(byte: int) -> bytes:
    return b"(?:" + _exactly(set(encodings(byte))) + b")"


def _tree(needles: list[bytes], i: int) -> bytes:
    """One regex for the needles' bytes from `i` on, with shared prefixes matched once."""
    out = b""
    while True:
        live = [n for n in needles if len(n) > i]
        ended = len(live) < len(needles)
        heads = sorted({n[i] for n in live})
        if len(heads) != 1 or ended:
            break
        out += _first_unit(heads[0]) if i == 0 else _unit(heads[0])
        i += 1
    unit = _first_unit if i == 0 else _unit
    # Longer forms first: a form that is a prefix of another (unpadded base64) comes last.
    branches = [unit(h) + _tree([n for n in live if n[i] == h], i + 1) for h in heads]
    if ended:
        branches.append(b"")
    if len(branches) == 1:
        return out + branches[0]
    return out + b"(?:" + b"|".join(branches) + b")"


@functools.cache
def _first_unit(byte: int) -> bytes:
    """_unit(byte) after its first byte was matched by the leading character class."""
    return _led(set(encodings(byte)))


def _led(texts: set[bytes]) -> bytes:
    """A regex matching exactly `texts` (non-empty) after their first byte was matched."""
    by_lead: dict[bytes, set[bytes]] = {}
    for e in texts:
        by_lead.setdefault(e[:1], set()).add(e[1:])
    alternatives = (
        b"(?<=" + re.escape(lead) + b")" + _exactly(rest) for lead, rest in sorted(by_lead.items())
    )
    return b"(?:" + b"|".join(alternatives) + b")"


@functools.cache
def _unfinished(byte: int) -> frozenset[bytes]:
    """The non-empty proper prefixes of the encodings of `byte` (`%`, `%4`, `&#x`, `\\u0` ...)."""
    return frozenset(e[:k] for e in encodings(byte) for k in range(1, len(e)))


def _heads(needles: list[bytes], i: int) -> bytes:
    """A regex for how the needles' encodings from byte `i` on begin: HEADS whole bytes, or
    fewer and then the end of the data, after a proper prefix of the next byte's encoding or
    none. Every unfinished form at the end of the data matches; few other places do."""
    if i == HEADS:
        return b""
    live = [n for n in needles if len(n) > i]
    branches = []
    for h in sorted({n[i] for n in live}):
        rest = _heads([n for n in live if n[i] == h], i + 1)
        branches.append((_first_unit(h) if i == 0 else _unit(h)) + rest)
        if _unfinished(h):
            branches.append((_led if i == 0 else _exactly)(set(_unfinished(h))) + rb"\Z")
    if i:
        branches.append(rb"\Z")
    return b"(?:" + b"|".join(branches) + b")"


@functools.cache
def _starts(byte: int) -> frozenset[int]:
    return frozenset(e[0] for e in encodings(byte))


def _class(chars: set[int]) -> bytes:
    if len(chars) == 1:
        return re.escape(bytes(chars))
    return b"[" + b"".join(re.escape(bytes((c,))) for c in sorted(chars)) + b"]"


def _literals(needles: list[bytes]) -> tuple[bytes, ...]:
    """Texts of which every needle holds one: a needle written literally contains its text.

    A needle without its base64 padding is still one (a prefix of it); one text that holds
    another is redundant.
    """
    texts = {n.rstrip(b"=") or n for n in needles}
    return tuple(sorted(t for t in texts if not any(o != t and o in t for o in texts)))


def _exactly(texts: set[bytes]) -> bytes:
    """A regex matching exactly `texts`: heads that share their continuations share a class."""
    if texts == {b""}:
        return b""
    after: dict[int, set[bytes]] = {}
    for text in texts - {b""}:
        after.setdefault(text[0], set()).add(text[1:])
    heads: dict[frozenset[bytes], set[int]] = {}
    for head, rest in after.items():
        heads.setdefault(frozenset(rest), set()).add(head)
    branches = sorted(_class(h) + _exactly(set(rest)) for rest, h in heads.items())
    out = branches[0] if len(branches) == 1 else b"(?:" + b"|".join(branches) + b")"
    return b"(?:" + out + b")?" if b"" in texts else out


@functools.lru_cache(maxsize=4096)
def _compile(secrets: tuple[bytes, ...]) -> _Compiled | None:
    """Built once per secret, not per request: the hot path only scans."""
    return prepare(secrets)


def prepare(secrets: Sequence[bytes]) -> _Compiled | None:
    """The compiled search for `secrets`, not cached: for a caller that keeps its own and
    builds it off the event loop (addon/redaction/redactset.py). None when no form is long
    enough."""
    needles = sorted({f for s in secrets for f in forms(s)}, key=len, reverse=True)
    if not needles:
        return None
    char_class = _class(set().union(*(_starts(n[0]) for n in needles)))
    # Led by a character class, so that the regex engine skips ahead to a possible first
    # byte instead of trying every form at every offset; the lookbehinds then say which.
    pattern = re.compile(char_class + _tree(needles, 0))
    starts = re.compile(char_class)
    tails = re.compile(char_class + _heads(needles, 0))
    longest = max(sum(max(map(len, encodings(b))) for b in n) for n in needles)
    alphabet = bytes(sorted({c for n in needles for b in n for e in encodings(b) for c in e}))
    return _Compiled(needles, pattern, starts, tails, longest, len(needles[-1]), alphabet)


# The longest escape (`\\u00hh`): a sieve hit inside one that the regex skipped past lies this
# close to the hit it reported.
_ESCAPE_MAX = max(len(e) for b in range(256) for e in encodings(b))
# More finder hits than one per this many bytes: one regex pass over the text is cheaper than
# checking each hit in Python (about 0.25 us each against 1 ns a byte).
_DENSE = 256
REPROBE = 8
# The sieve's unit: a longer piece is sieved in overlapping slices of this size.
SLICE = 64 * 1024


class _Compiled:
    __slots__ = (
        "needles",
        "pattern",
        "starts",
        "tails",
        "longest",
        "shortest",
        "alphabet",
        "literals",
        "finder",
        "escape",
        "reach",
        "keys",
        "escaped",
        "before",
        "after",
        "led",
    )

    def __init__(
        self,
        needles: list[bytes],
        pattern: re.Pattern[bytes],
        starts: re.Pattern[bytes],
        tails: re.Pattern[bytes],
        longest: int,
        shortest: int,
        alphabet: bytes,
    ) -> None:
        self.needles, self.pattern, self.starts, self.tails = needles, pattern, starts, tails
        self.longest, self.shortest = longest, shortest
        # Every byte any encoding of any needle is written with.
        self.alphabet = alphabet
        self.literals = _literals(needles)
        # The needles an encoded form beginning with a byte may be of, by that byte: a tail
        # is walked (`_begins`) only for those.
        led: dict[int, list[bytes]] = {}
        for n in needles:
            for start in sorted(_starts(n[0])):
                led.setdefault(start, []).append(n)
        self.led = {start: tuple(ns) for start, ns in led.items()}
        escapes = {e for b in {b for n in needles for b in n} for e in encodings(b)[1:]}
        # The texts first: leftmost-first prefers the earlier pattern where two begin at once.
        leads = sorted({e[:2] for e in escapes})
        self.finder = ahocorasick_rs.BytesAhoCorasick(
            [*self.literals, *leads], matchkind=ahocorasick_rs.MATCHKIND_LEFTMOST_FIRST
        )
        self.escape = re.compile(_exactly(escapes))
        # A hit the finder skipped begins inside one it reported (a text, or an escape's lead).
        self.reach = longest + max(_ESCAPE_MAX, *map(len, self.literals))
        # Text dense with escape leads is sieved by a second finder (built when a stream first
        # is, `_exact`): the texts and every whole escape of a form's byte, each escape then
        # kept only between what may precede and follow that byte in a form.
        self.keys = [*self.literals]
        self.escaped: list[int] = []
        for byte in sorted({b for n in needles for b in n}):
            for e in encodings(byte)[1:]:
                if e not in self.literals:
                    self.keys.append(e)
                    self.escaped.append(byte)
        before: dict[int, set[int]] = {}
        after: dict[int, set[int]] = {}
        first, last = {n[0] for n in needles}, {n[-1] for n in needles}
        for n in needles:
            for i in range(1, len(n)):
                before.setdefault(n[i], set()).add(n[i - 1])
                after.setdefault(n[i - 1], set()).add(n[i])
        # None: the byte may begin (end) a form, so nothing need precede (follow) it.
        self.before: dict[int, tuple[bytes, ...] | None] = {
            b: None if b in first else _written(before[b]) for b in set(before) | first
        }
        self.after: dict[int, tuple[bytes, ...] | None] = {
            b: None if b in last else _written(after[b]) for b in set(after) | last
        }

    def suspect(self, data: bytes, dense: bool = False) -> tuple[bool, bool]:
        """May `data` hold an encoded form (False only when the pattern cannot match), and
        was it dense with escape starts?

        Every match holds a sieve hit (a literal text or an escape) and is at most `longest`
        long, so it lies within `reach` of a reported hit: only those windows are searched.
        `dense` says that the stream's last piece was: the finder is then not run first.
        A piece longer than SLICE (a decoded chunk may reach DECODE_LIMIT) is sieved a slice
        at a time, each overlapping the next by `longest`, so that every match lies whole in
        one: the lists of hits stay bounded by the slice, not by what the upstream sends.
        """
        if len(data) > SLICE + self.longest:
            for lo in range(0, len(data), SLICE):
                suspect, dense = self.suspect(data[lo : lo + SLICE + self.longest], dense)
                if suspect:
                    return True, dense
            return False, dense
        if not dense:
            found = self.finder.find_matches_as_indexes(data)
            if not found:
                return False, False
            dense = len(found) > 8 and len(found) * _DENSE > len(data)
        if dense:
            found = _exact(self).find_matches_as_indexes(data, overlapping=True)
            if len(found) * _KEPT > len(data):
                # Whole escapes of the forms' bytes this dense (`\\/` in JSON): checking each
                # costs more than one search of the piece.
                return self.pattern.search(data) is not None, dense
            hits = self._kept(data, found)
        else:
            hits = self._checked(data, found)
        if not hits:
            return False, dense
        if len(hits) * self.reach > len(data):
            # Windows as wide as the data: one search beats one per window.
            return self.pattern.search(data) is not None, dense
        hits.sort()
        reach, search = self.reach, self.pattern.search
        lo, hi = max(0, hits[0] - reach), hits[0] + reach
        for at in hits:
            if at - reach > hi:
                if search(data, lo, hi):
                    return True, dense
                lo = at - reach
            hi = at + reach
        return search(data, lo, hi) is not None, dense

    def _checked(self, data: bytes, found: list[tuple[int, int, int]]) -> list[int]:
        """The finder's hits that are a text, or the lead of an escape of a form's byte inside
        a run of the forms' alphabet at least as long as the shortest form.

        The finder reports no overlaps: a text or escape beginning inside a reported lead
        (one byte on; a lead is at most two bytes) is not reported, so that byte is checked
        too. (An escape can begin there only after the lead `\\\\`, itself an escape.) A form
        is written in the alphabet only and is at least `shortest` long, and a lead's first
        byte is in the alphabet too: a form holding the lead or the byte after it lies in a
        run that long. In binary data runs are a few bytes, so most hits end there.
        """
        texts, match, literals = len(self.literals), self.escape.match, self.literals
        alphabet, shortest = self.alphabet, self.shortest
        hits = []
        for index, at, _ in found:
            if index < texts:
                hits.append(at)
                continue
            before = data[max(0, at - shortest) : at]
            after = data[at : at + shortest + 1]
            run = len(before) - len(before.rstrip(alphabet))
            run += len(after) - len(after.lstrip(alphabet))
            if run < shortest:
                continue
            if match(data, at) or match(data, at + 1) or data.startswith(literals, at + 1):
                hits.append(at)
        return hits

    def _kept(self, data: bytes, found: list[tuple[int, int, int]]) -> list[int]:
        """The exact finder's hits that may lie in a form: every text, and each escape of a
        byte that follows what may precede that byte in a form and is followed by what may
        follow it, inside a run of the forms' alphabet at least as long as the shortest form.

        A form written with an escape holds that escape whole (the finder reports every one,
        overlapping ones too), and the bytes of the form before and after it, encoded, right
        beside it: the data before it ends with an encoding of the form's previous byte unless
        the escaped byte begins the form, and likewise after. Each check is necessary, so the
        hits kept still include one inside every match.
        """
        texts, escaped, before, after = len(self.literals), self.escaped, self.before, self.after
        alphabet, shortest = self.alphabet, self.shortest
        hits = []
        for index, at, end in found:
            if index < texts:
                hits.append(at)
                continue
            byte = escaped[index - texts]
            ahead, behind = after[byte], before[byte]
            if ahead is not None and not data.startswith(ahead, end):
                continue
            if behind is not None and not data.endswith(behind, 0, at):
                continue
            lead = data[max(0, at - shortest) : at]
            run = len(lead) - len(lead.rstrip(alphabet)) + end - at
            if run < shortest:
                trail = data[end : end + shortest]
                run += len(trail) - len(trail.lstrip(alphabet))
                if run < shortest:
                    continue
            hits.append(at)
        return hits


def _written(bytes_: set[int]) -> tuple[bytes, ...]:
    """Every encoding of any of `bytes_`."""
    return tuple(sorted({e for b in bytes_ for e in encodings(b)}))


# More whole escapes of the forms' bytes than one per this many bytes: one search of the piece
# costs less than checking each (about 0.4 us each).
_KEPT = 64


@functools.lru_cache(maxsize=32)
def _exact(c: _Compiled) -> ahocorasick_rs.BytesAhoCorasick:
    """The dense sieve's finder for `c`: its texts and every whole escape of its forms' bytes,
    a DFA (it scans escape-dense text several times faster than the default automaton, and
    costs about 0.9 MB for four secrets: built on first use, 32 kept)."""
    return ahocorasick_rs.BytesAhoCorasick(c.keys, implementation=ahocorasick_rs.Implementation.DFA)


def _begins(data: bytes, pos: int, needle: bytes) -> bool:
    """Is data[pos:] (non-empty) a proper prefix of some encoding of `needle`?"""
    end = len(data)
    stack = [(pos, 0)]
    while stack:
        at, i = stack.pop()
        if at == end:
            return True
        if i == len(needle):
            continue  # a whole form and more: not a prefix
        rest = end - at
        for enc in encodings(needle[i]):
            if rest < len(enc):
                if enc.startswith(data[at:]):
                    return True
            elif data.startswith(enc, at):
                stack.append((at + len(enc), i + 1))
    return False


class Redactor:
    """Replaces every form of the secrets in a stream, across chunk boundaries.

    Holds back only a tail that could be the start of a secret, so a stream of events is
    not delayed when nothing in it resembles one.
    """

    def __init__(self, secrets: Sequence[bytes], prepared: _Compiled | None = None) -> None:
        """`prepared`: what prepare(secrets) returned, if the caller has it."""
        self._c = prepared if prepared is not None else _compile(tuple(secrets))
        self._tail = b""
        self._dense, self._pieces = False, 0
        # The end of a stream as flushed: it may begin a form that its trailers finish.
        self.flushed = b""
        self.count = 0

    def _sub(self, data: bytes) -> bytes:
        assert self._c is not None
        # A stream dense with escape starts stays sieved by the regex pass, but for every
        # REPROBE-th piece, which tries the finder again.
        self._pieces += 1
        suspect, dense = self._c.suspect(data, self._dense and self._pieces % REPROBE != 0)
        self._dense = dense
        if not suspect:
            return data
        pattern = self._c.pattern
        for _ in range(MAX_PASSES):
            data, n = pattern.subn(MARK, data)
            if not n:
                return data
            # A secret with `[` or `]` can re-form across a MARK: scan again.
            self.count += n
        if pattern.search(data):
            raise Unredactable("a form of the secret survives redaction")
        return data

    def partial(self, data: bytes) -> int:
        """Length of the longest suffix of `data` that could begin an encoded secret form."""
        c = self._c
        if c is None:
            return 0
        # A suffix that begins an encoded form is written in the forms' alphabet only.
        tail = data[max(0, len(data) - c.longest + 1) :]
        run = len(tail) - len(tail.rstrip(c.alphabet))
        if not run:
            return 0
        # The regex rules out most places (in hex text, every hex digit that begins a form).
        at, search = len(data) - run, c.tails.search
        while (m := search(data, at)) is not None:
            at = m.start()
            if any(_begins(data, at, n) for n in c.led.get(data[at], ())):
                return len(data) - at
            at += 1
        return 0

    def feed(self, chunk: bytes) -> bytes:
        """Redacted bytes that are safe to send now; b"" flushes the held-back tail."""
        if self._c is None:
            return chunk
        if not chunk:
            rest, self._tail = self._tail, b""
            self.flushed = self._sub(rest)
            return self.flushed
        raw = self._tail + chunk
        count = self.count
        data = self._sub(raw)
        if self.count == count:
            # Nothing replaced: no form is whole, so holding back the unfinished tail is enough.
            hold = self.partial(data)
            emit, self._tail = data[: len(data) - hold], data[len(data) - hold :]
            return emit
        # A form was replaced. A longer one may hold it and be unfinished at the end (two
        # secrets, one inside the other), which the replacement hides: cut the raw text where
        # it could begin a form, never inside one, and keep the rest raw for the next chunk.
        # What is left of the text before the cut may begin a form with what follows it (a
        # secret whose forms overlap themselves, `aaaa`): held back too, as above.
        self.count = count
        cut = self._cut(raw)
        head = self._sub(raw[:cut])
        hold = self.partial(head)
        emit, self._tail = head[: len(head) - hold], head[len(head) - hold :] + raw[cut:]
        return emit

    def _cut(self, raw: bytes) -> int:
        """Where to cut `raw`: before any suffix that could begin a form, and before the first
        form that would straddle that point (one step: what is held stays under three times
        the longest form)."""
        c = self._c
        assert c is not None
        cut = len(raw) - self.partial(raw)
        # Every place a form may begin, overlapping ones too (rare: only after a replacement).
        for m in c.starts.finditer(raw, max(0, cut - c.longest), cut):
            form = c.pattern.match(raw, m.start())
            if form is not None and form.end() > cut:
                return m.start()
        return cut

    def whole(self, body: bytes) -> bytes:
        """Redact a complete body (nothing held back: there is no next chunk)."""
        if self._c is None or len(body) < self._c.shortest:
            return body  # shorter than the shortest form of a secret
        return self._sub(body)

    def trailers(self, fields: tuple[tuple[bytes, bytes], ...]) -> tuple[tuple[bytes, bytes], ...]:
        """Trailer fields redacted like headers; one finishing a form the body began is dropped."""
        kept = []
        for name, value in self.headers(fields):
            if self.spans(self.flushed, name) or self.spans(self.flushed, value):
                self.count += 1
            else:
                kept.append((name, value))
        return tuple(kept)

    def spans(self, before: bytes, after: bytes) -> bool:
        """Does a form start in `before` (already sent, redacted) and end in `after`?"""
        if self._c is None or not before:
            return False
        m = self._c.pattern.search(before + after)
        return m is not None and m.start() < len(before)

    def headers(self, fields: tuple[tuple[bytes, bytes], ...]) -> tuple[tuple[bytes, bytes], ...]:
        """Redact header values; a field whose name holds a secret is dropped (and counted).

        One search over every name and value decides; `fields` comes back as it is when it
        holds no secret, the usual case.
        """
        if self._c is None:
            return fields
        pattern = self._c.pattern
        if not pattern.search(b"\n".join(b"\n".join(f) for f in fields)):
            return fields
        kept = []
        for name, value in fields:
            if pattern.search(name):
                self.count += 1
            else:
                kept.append((name, self._sub(value)))
        return tuple(kept)


# What one chunk of a compressed response may decode to: past it the response is a bomb, and
# the flow is killed. A 64 KiB chunk may expand 128-fold.
DECODE_LIMIT = 8 * 1024 * 1024


class DecodeLimit(ValueError):
    """A compressed chunk decodes to more than DECODE_LIMIT."""


class _Capped:
    """A sink for zstandard's stream writer that refuses more than DECODE_LIMIT per feed."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0

    def write(self, data: bytes) -> int:
        self.size += len(data)
        if self.size > DECODE_LIMIT:
            raise DecodeLimit("a compressed chunk decodes past the limit")
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out, self.parts, self.size = b"".join(self.parts), [], 0
        return out


class Decoder:
    """Undo a response's Content-Encoding chunk by chunk, so redaction sees the plaintext.

    Every decoder's output is bounded per chunk (DECODE_LIMIT). Brotli's Python decoder
    cannot bound its output (200 bytes can expand to 248 MiB), so `br` is refused.

    Raises: ValueError for an encoding it does not decode; DecodeLimit from `feed`.
    """

    def __init__(self, encoding: str) -> None:
        self._flush: Callable[[], bytes] = lambda: b""
        if encoding in ("gzip", "x-gzip", "deflate"):
            # 32 + 15: accept a gzip or zlib header.
            inflater = zlib.decompressobj(wbits=47)

            def inflate(chunk: bytes) -> bytes:
                out = inflater.decompress(chunk, DECODE_LIMIT)
                if inflater.unconsumed_tail:
                    raise DecodeLimit("a compressed chunk decodes past the limit")
                return out

            self._decode: Callable[[bytes], bytes] = inflate
            self._flush = inflater.flush
        elif encoding == "zstd":
            import zstandard

            sink = _Capped()
            writer = zstandard.ZstdDecompressor().stream_writer(sink, write_size=65536)  # type: ignore[arg-type]

            def unzstd(chunk: bytes) -> bytes:
                writer.write(chunk)
                return sink.take()

            self._decode = unzstd
        else:
            raise ValueError(f"unsupported content-encoding {encoding!r}")

    def feed(self, chunk: bytes) -> bytes:
        """Decoded bytes; b"" flushes."""
        return self._decode(chunk) if chunk else self._flush()
