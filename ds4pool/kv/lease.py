"""SessionLease: the scheduler's one handle on a session for one request.

    pool.acquire ──► prepare(prompt) ──► restore() ──► reserve(n) ──► table() ──► offer(...)
                      │ Prepared(ids, counts)                               step by step
                      ├─► keep_prepared()  the request waits for blocks meanwhile
                      ▼
                     commit(ids, text, n) | rollback() ──► release()

A lease owns its session's tokens, text and KV until `release()`: `SessionPool.acquire` gives
out one lease per session at a time (the session is `in_flight`), and what else touches a
session skips in-flight ones (pressure demotions, persistence, read-ahead, admin moves). So,
while leased:

- the tokens, text and KV change only through this lease (one exception: RAM pressure may
  spill a leased RAM session's host copy to disk, tokens included; `prepare` and `restore`
  read it back), so a count read from it (`num_computed`) stays true until its next call;
- `table()` is a copy of ids: it stays valid until the next `reserve`, `commit`, `rollback`
  or `demote` (its epoch changes on any change other than an append);
- `rollback()` puts back the state `prepare` left (the reused tokens and their KV; the old
  text only where it still stands for them exactly): the lease keeps it, not its caller;
- after `release()` every call is a bug (asserted).

Every method takes the pool lock itself, except the tokenization of `prepare`, which runs
outside it (a long prompt's text must not hold up the prefetch thread and the admin routes),
and what every decode step calls, `has_room`, `table()` and a `reserve` whose last block has
room: they read only the session's own block table, which nothing but this lease (on the
scheduler's thread) changes while leased (above).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ds4pool.errors import OutOfBlocksError
from ds4pool.kv.blocks import BlockTable
from ds4pool.kv.lease_parts import PoolParts, truncate_kv
from ds4pool.kv.match import Prepared, match_prompt
from ds4pool.kv.prefix import TextPlan, plan_text, valid_marks
from ds4pool.kv.session import Session, SessionKey, Tier


class BlocksNeverFitError(OutOfBlocksError):
    """More KV blocks than the whole device pool holds: waiting or preempting cannot help."""


@dataclass(frozen=True)
class TableView:
    """The ids of the session's device blocks, for the runner's SeqInput."""

    block_ids: list[int]
    epoch: int  # changes on any change but an append (the runner uploads diffs)


class SessionLease:
    def __init__(self, parts: PoolParts, session: Session) -> None:
        assert session.in_flight
        self._p = parts
        self._s = session
        self._released = False
        self._prepared: Prepared | None = None
        self._view: TableView | None = None  # the last table(), reused while it holds
        self._prompt_text: str | None = None
        # the state prepare() left, for rollback(): tokens (KV for all) and their text
        self._rollback: tuple[list[int], str] = ([], "")

    @property
    def key(self) -> SessionKey:
        return self._s.key

    @property
    def session(self) -> Session:
        """The session itself, for the pool's parts and tests; the scheduler never reads it."""
        return self._s

    @property
    def num_computed(self) -> int:
        """Tokens of the session with KV now (a preempted request's may have been lost)."""
        with self._p.cond:
            return self._live().num_computed

    def _live(self) -> Session:
        assert not self._released, f"{self._s.key}: lease used after release"
        return self._s

    # ------------------------------------------------------------ prepare

    def prepare(
        self,
        *,
        prompt_ids: Sequence[int] | None = None,
        prompt_text: str | None = None,
        tokenize: Callable[[str], list[int]] | None = None,
        priority: int = 0,
    ) -> Prepared:
        """Decide the new prompt's tokens and how many leading ones reuse cached KV; drop the
        KV past that point. When the rendered text extends the session's text, the cached
        tokens are kept as they are and only the new text is tokenized (BPE merges across
        the old/new boundary would otherwise make a token match miss). When the block index
        holds a longer chain of the prompt's blocks than the session's own KV (another
        session's system prompt, this session's other branch), the session takes those
        blocks instead (kv/sharing.py). Tokenization runs without the pool lock."""
        assert prompt_ids is not None or (prompt_text is not None and tokenize is not None)
        while True:
            with self._p.cond:
                s = self._live()
                self._p.tiers.load(s)
                seen = (s.token_ids, s.text, s.text_marks)
                plan: TextPlan | None = None
                if prompt_text is not None and tokenize is not None:
                    plan = plan_text(s.text_marks, s.token_ids, s.text, prompt_text)
                    if not plan.via_text and prompt_ids is not None:
                        plan = None  # ids given and the text diverged: the ids are the prompt
                kept = s.token_ids[: plan.num_kept] if plan is not None else []
            # outside the lock: the session is leased, only its own calls change its tokens
            if plan is not None:
                assert prompt_text is not None and tokenize is not None
                ids = kept + tokenize(prompt_text[plan.from_char :])
            else:
                assert prompt_ids is not None
                ids = list(prompt_ids)
            with self._p.cond:
                # ... but RAM pressure may have spilled its host copy to disk meanwhile,
                # tokens included (tiers.py): then read it back and plan again
                if (s.token_ids, s.text, s.text_marks) == seen and s.loaded:
                    text_only = prompt_text if prompt_ids is None else None
                    m = match_prompt(self._p, s, ids, plan, text_only, priority)
                    break
        num_old, old_text = len(seen[0]), seen[1]
        # the session as matching left it; its old text still stands for the reused tokens
        # only when all of the old tokens were kept
        keeps_text = m.via_text and not m.num_shared and m.num_cached == num_old
        self._rollback = (m.token_ids[: m.num_cached], old_text if keeps_text else "")
        self._prepared, self._prompt_text = m, prompt_text
        return m

    def keep_prepared(self) -> None:
        """The prepared request waits for blocks and lets go of the session meanwhile: leave
        it holding the prompt's tokens as matched (KV for the cached ones) and the text they
        stand for, so that the next prepare gives exactly these tokens again. Preparing
        cleared the session's text; without it the next match would re-tokenize the whole
        prompt, and reply tokens as sampled are not the text's canonical tokens: the request
        would compute other token ids than had it not waited."""
        m = self._prepared
        assert m is not None
        self.commit(m.token_ids, self._prompt_text or "", m.num_cached)

    # ------------------------------------------------------------ blocks

    def restore(self) -> None:
        """Bring the session's KV to the device (making room if needed)."""
        p = self._p
        with p.cond:
            s = self._live()
            p.tiers.load(s)
            if s.tier is Tier.DEVICE:
                return
            move = p.tiers.begin_restore(s)
            table = BlockTable(p.cfg.block_size)
            shared = p.sharing.share_for_restore(s, table)  # only the rest is copied
            try:
                p.make_room(table.blocks_needed(s.num_computed), s)
                table.ensure(p.blocks, s.num_computed)
            except OutOfBlocksError:
                table.release(p.blocks)
                p.tiers.abort_restore(s, move)
                raise
            move = p.planner.plan_copy(s, move, shared)  # copy the rest, or recompute it
            p.planner.copy_in(s, move, table, shared)
            p.tiers.finish_restore(s, move, table, start=shared, copied=True)
            p.sharing.restored_into(s, table)

    def reserve(self, num_tokens: int) -> None:
        """Room for num_tokens tokens of KV on the device (blocks the session shares count
        once: they are in its table already), demoting idle sessions if needed.
        OutOfBlocksError when the running ones hold the rest; BlocksNeverFitError when even
        the whole pool is too small."""
        if self.has_room(num_tokens):  # the usual decode step
            return
        p = self._p
        with p.cond:
            s = self._live()
            assert s.tier is Tier.DEVICE and s.block_table is not None
            need = s.block_table.blocks_needed(num_tokens)
            if need == 0 and s.block_table.epoch:
                return
            total = need + len(s.block_table.blocks)
            if total > p.blocks.num_blocks:
                raise BlocksNeverFitError(
                    f"{num_tokens} tokens need {total} KV blocks; "
                    f"the device pool has {p.blocks.num_blocks}"
                )
            p.make_room(need, s)
            s.block_table.ensure(p.blocks, num_tokens)

    def has_room(self, num_tokens: int) -> bool:
        """The session's device blocks hold num_tokens already (`reserve` would change
        nothing). Read without the pool lock: while leased, only this lease changes the
        session's table (see the module docstring), so what is read here cannot move."""
        s = self._live()
        t = s.block_table
        if t is None or not t.epoch or s.tier is not Tier.DEVICE:
            return False
        return num_tokens <= t.capacity

    def blocks_to_hold(self, num_tokens: int) -> int:
        """Device blocks the session lacks to hold num_tokens (all of them when it is off the
        device: an estimate, a restore may share some)."""
        with self._p.cond:
            s = self._live()
            if s.tier is Tier.DEVICE and s.block_table is not None:
                return s.block_table.blocks_needed(num_tokens)
            return -(-num_tokens // self._p.cfg.block_size)

    def table(self) -> TableView:
        # Without the pool lock, as reserve's room check: only this lease changes the table.
        t = self._live().block_table
        assert t is not None, "table() of a session off the device"
        view = self._view
        # a table only grows within an epoch: same epoch and length, same ids. A decode
        # step must not copy its whole table every step (the view is read-only)
        if view is None or view.epoch != t.epoch or len(view.block_ids) != len(t.blocks):
            view = self._view = TableView(list(t.blocks), t.epoch)
        return view

    def offer(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int], num_computed: int
    ) -> None:
        """Share the full blocks the request has computed (its tokens are prompt_ids +
        output_ids, the first num_computed with KV): a prompt admitted next finds them."""
        with self._p.cond:
            self._p.sharing.offer(self._live(), prompt_ids, output_ids, num_computed)

    def demote(self, to: Tier, reason: str) -> None:
        """Move the session's KV down (a preempted request: it keeps the lease)."""
        with self._p.cond:
            self._p.tiers.demote(self._live(), to, reason)

    # ------------------------------------------------------------ end of a turn

    def commit(self, token_ids: Sequence[int], text: str, num_computed: int) -> None:
        """Record the session's state after (part of) a turn: KV exists for the first
        num_computed of token_ids, and `text` is exactly what token_ids stand for."""
        p = self._p
        with p.cond:
            s = self._live()
            assert num_computed <= len(token_ids)
            s.token_ids, s.text = list(token_ids), text
            s.text_marks = valid_marks(s.text_marks, len(s.token_ids), len(text))
            s.num_computed = truncate_kv(p, s, num_computed)
            del s.block_keys[s.num_computed // p.cfg.block_size :]
            s.version = p.next_version()
            s.last_used = time.time()

    def rollback(self) -> None:
        """Back to the state prepare() left (a failed step: KV length == token count)."""
        assert self._prepared is not None, "rollback() before prepare()"
        ids, text = self._rollback
        self.commit(ids, text, len(ids))

    def truncate(self, num_tokens: int) -> None:
        """Keep the first num_tokens tokens (KV and token ids)."""
        with self._p.cond:
            s = self._live()
            del s.token_ids[num_tokens:]
            truncate_kv(self._p, s, min(num_tokens, s.num_computed))

    def release(self) -> None:
        """End the lease; an ephemeral session is discarded."""
        p = self._p
        with p.cond:
            s = self._live()
            self._released = True
            s.in_flight = False
            s.last_used = time.time()
            if p.tiers.store is not None and not s.ephemeral:
                p.tiers.store.touch(s.key)  # renew its store lease for another ttl
            if s.tier is Tier.RAM and s.key not in p.tiers.ram and not s.ephemeral:
                p.tiers.file_in_ram(s)  # read from disk, then the request ended before restore
            writer = p.tiers.writer
            if s.ephemeral:
                p.discard(s)
            elif writer and 0 < p.cfg.persist_every_tokens <= s.dirty_tokens:
                writer.enqueue(s.key)
            p.cond.notify_all()
