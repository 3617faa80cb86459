"""What followed each n-gram in the sequences the engine has drafted for, shared across requests
(`NgramHistory`), so a request can draft from text an earlier request produced: a template answered
again, a document asked about twice, a loop another request already ran. llama.cpp's `ngram-mod` keeps
such a pool across its server's slots.

Keys are n tokens long (longer than a request's own look-up n-grams: across requests, more context is
needed before the next token is a good guess), hashed with the requests' `cache_salt`, so requests of
different salts never draft from each other's text (the prefix cache's rule: a draft changes nothing
but the speed, but the speed would tell one tenant what another generated). A hash collision only
makes a wrong draft, which verification rejects. The table is bounded: past `capacity` entries, the
quarter written longest ago is dropped.
"""

from __future__ import annotations

from itertools import islice

HISTORY_CAPACITY = 1 << 18  # entries, at most


class NgramHistory:
    def __init__(self, n: int, capacity: int) -> None:
        if n < 1 or capacity < 1:
            raise ValueError(f"need n >= 1 and capacity >= 1, got {n} and {capacity}")
        self.n, self.capacity = n, capacity
        self.next_token: dict[int, int] = {}  # hash of (salt, n-gram) -> the token that followed it last

    def __len__(self) -> int:
        return len(self.next_token)

    def clear(self) -> None:
        self.next_token.clear()

    def learn(self, salt: str | None, tokens: list[int], start: int) -> int:
        """Enters what followed each n-gram ending at positions `start` to len(tokens) - 2, and returns
        where the next call starts (the last token's follower is not known yet)."""
        n, table = self.n, self.next_token
        for end in range(max(start, n - 1), len(tokens) - 1):
            key = hash((salt, *tokens[end - n + 1 : end + 1]))
            table.pop(key, None)  # re-inserted: the latest write is the youngest entry
            table[key] = tokens[end + 1]
        if len(table) > self.capacity:
            for key in list(islice(table, len(table) // 4)):
                del table[key]
        return max(start, len(tokens) - 1)

    def follow(self, salt: str | None, tokens: list[int], length: int) -> list[int]:
        """Up to `length` tokens that followed the sequence's last n tokens before, each next one looked
        up by the n tokens before it (drafted ones included); empty when the history does not know them."""
        n = self.n
        if len(tokens) < n:
            return []
        window, out = tokens[-n:], []
        while len(out) < length:
            token = self.next_token.get(hash((salt, *window)))
            if token is None:
                break
            out.append(token)
            window = window[1:] + [token]
        return out
