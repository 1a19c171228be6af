//! Publishing a batch in order: parking what cannot go now (`park`), pausing for a
//! broker outage, dead letters, the crash-loop guard.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use outboxkit_core::{
    ErrorKind, EventPublisher, MessageStatus, OutboxError, OutboxMessage, PublishError,
    PublishOutcome,
};
use pgwire_replication::Lsn;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use uuid::Uuid;

use super::WalRelay;
use super::gather::Gathered;
use super::park::{Admit, Parked, ParkedRow, dead_for_good, order_key, outcome_text};
use super::pipeline::{InFlight, Pipeline};
use super::record::{Checked, Outcomes, Recording, Whose};
use super::session::{Item, SessionStart};
use crate::wal::WalError;

impl<P: EventPublisher> WalRelay<P> {
    /// [`publish_keyed`] by this relay's publisher and ordering.
    pub(super) async fn publish_keyed(
        &self,
        messages: &[OutboxMessage],
        keys: &[&str],
    ) -> Vec<Option<PublishOutcome>> {
        publish_keyed(&*self.publisher, self.config.per_key(), messages, keys).await
    }

    /// Records `out` (the stream's) once the recording in flight has ended: outcomes
    /// reach the table in stream order.
    async fn record_in_turn(
        &self,
        recording: &mut Recording,
        out: &Outcomes,
        parked: &Parked,
        shutdown: &CancellationToken,
    ) -> Result<bool, WalError> {
        if out.is_empty() {
            return Ok(true);
        }
        if !recording.settle().await? {
            return Ok(false);
        }
        self.record(out, Whose::Pending, parked, shutdown).await
    }

    /// Publishes `batch` (the stream's changes up to `upto`, see [`flush`](Self::flush)),
    /// a large transaction in parts of `part_size` rows read back from the table: the
    /// items before it first (confirmed up to the end of the transaction before it),
    /// then each part, the position confirmed past the transaction only after its last
    /// part (by the caller, as for any batch). Between parts a shutdown ends it
    /// (`Ok(false)`), the part being recorded settled first: the next session reads the
    /// transaction again from its start and skips what the table records.
    #[allow(clippy::too_many_arguments)] // reason: the stream's state, passed down
    pub(super) async fn flush_gathered(
        &self,
        batch: &mut Gathered,
        upto: Option<Lsn>,
        state: &mut SessionStart,
        parked: &Arc<Parked>,
        recording: &mut Recording,
        pipeline: &mut Pipeline,
        shutdown: &CancellationToken,
    ) -> Result<bool, WalError> {
        let Gathered {
            items,
            xids,
            large,
            before_tx,
            ..
        } = batch.take();
        if large.is_empty() {
            return self
                .flush(
                    items, xids, upto, state, parked, recording, pipeline, shutdown,
                )
                .await;
        }
        if !items.is_empty() {
            if !self
                .flush(
                    items,
                    xids.clone(),
                    before_tx,
                    state,
                    parked,
                    recording,
                    pipeline,
                    shutdown,
                )
                .await?
            {
                return Ok(false);
            }
            recording.after(before_tx);
        }
        let parts = large.chunks(self.config.part_size);
        let count = parts.len();
        info!(
            rows = large.len(),
            parts = count,
            "a large transaction: published in parts read back from the table"
        );
        for (n, part) in parts.enumerate() {
            if shutdown.is_cancelled() {
                // Recorded, what was published: the next session skips it.
                let _ = self
                    .drain(pipeline, state, parked, recording, shutdown)
                    .await;
                let _ = recording.settle().await;
                return Ok(false);
            }
            let items = part.iter().map(|&id| Item::Replay(id)).collect();
            let part_upto = if n + 1 == count { upto } else { before_tx };
            if !self
                .flush(
                    items,
                    xids.clone(),
                    part_upto,
                    state,
                    parked,
                    recording,
                    pipeline,
                    shutdown,
                )
                .await?
            {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Publishes `items` (the stream's changes up to `upto`, of transactions `xids`) in
    /// order, rows to read back (`Item::Replay`) read in one query, and records the
    /// outcomes, those of its last round in the background (`recording`) while the
    /// next batch is read and published. Past a session's careful start, a batch of
    /// messages only is launched into the `pipeline` instead, its outcomes handled
    /// when they come back (see `pipeline`). `Ok(false)`: shutdown came during an
    /// outage or a backoff, and not everything was confirmed.
    #[allow(clippy::too_many_arguments)] // reason: the stream's state, passed down
    async fn flush(
        &self,
        items: Vec<Item>,
        xids: Vec<u32>,
        upto: Option<Lsn>,
        state: &mut SessionStart,
        parked: &Arc<Parked>,
        recording: &mut Recording,
        pipeline: &mut Pipeline,
        shutdown: &CancellationToken,
    ) -> Result<bool, WalError> {
        // Nothing is read, published or recorded before the batch's transactions are
        // visible to other sessions: the WAL can hold a commit before it is (its
        // backend waits for a synchronous standby, or is between writing the commit
        // and leaving the process array). Recording then would change no row and the
        // position would be confirmed past it: the row would stay New for ever, and a
        // consumer reading the data back would not find it. The same query gives the
        // database's time and the keys with parked rows (`Checked`), after the
        // batches in flight that must land first have landed: nothing parked after it
        // escapes it (see `Parked::begin_lookup`).
        let steady = !state.catching_up && state.careful_left == 0 && state.guarded;
        if steady && items.iter().all(|i| matches!(i, Item::Message(_))) {
            let messages: Vec<OutboxMessage> = items
                .into_iter()
                .filter_map(|i| match i {
                    Item::Message(m) => Some(*m),
                    _ => None,
                })
                .collect();
            let keys: Vec<String> = messages.iter().map(order_key).collect();
            // Room in the pipeline; with per-key order, no key of the batch in flight.
            while pipeline.is_full() || pipeline.holds_any(&keys) {
                if !self
                    .land_next(pipeline, state, parked, recording, shutdown)
                    .await?
                {
                    return Ok(false);
                }
            }
            let Some(checked) = self.wait_visible(&xids, &keys, parked, shutdown).await? else {
                return Ok(false);
            };
            outboxkit_core::metrics::claimed(messages.len());
            self.launch(messages, keys, parked, pipeline, upto, &checked);
            return Ok(true);
        }
        if !self
            .drain(pipeline, state, parked, recording, shutdown)
            .await?
        {
            return Ok(false);
        }
        let item_keys: Vec<String> = items
            .iter()
            .filter_map(|i| match i {
                Item::Message(m) => Some(order_key(m)),
                _ => None,
            })
            .collect();
        let Some(mut checked) = self
            .wait_visible(&xids, &item_keys, parked, shutdown)
            .await?
        else {
            return Ok(false);
        };
        // A replayed row is read back from the table: after the recording in flight,
        // which may hold its earlier outcome.
        if items.iter().any(|i| matches!(i, Item::Replay(_))) && !recording.settle().await? {
            return Ok(false);
        }
        // Rows read back, in one query.
        let replayed: Vec<Uuid> = items
            .iter()
            .filter_map(|i| match i {
                Item::Replay(id) => Some(*id),
                _ => None,
            })
            .collect();
        let mut read_back: HashMap<Uuid, Result<OutboxMessage, OutboxError>> =
            if replayed.is_empty() {
                HashMap::new()
            } else {
                self.outbox
                    .get_many_for_publish(&replayed)
                    .await?
                    .into_iter()
                    .collect()
            };
        let mut messages = Vec::with_capacity(items.len());
        let mut dead = Vec::new();
        for item in items {
            match item {
                Item::Message(m) => messages.push(*m),
                Item::Poison { id, reason } => {
                    warn!(%id, %reason, "poison row: it cannot be decoded, it is dead");
                    outboxkit_core::metrics::dead_poison();
                    dead.push((id, format!("undecodable row: {reason}")));
                }
                // Decoded as for publishing: a row spoiled by the update is poison.
                // (Taken: an id gathered twice goes once.)
                Item::Replay(id) => match read_back.remove(&id) {
                    Some(Ok(m)) if m.status == MessageStatus::New => messages.push(m),
                    Some(Ok(_)) | None => {}
                    // The row as it is now does not decode: it dies alone.
                    Some(Err(e)) => {
                        warn!(%id, error = %e, "poison row: it cannot be decoded, it is dead");
                        outboxkit_core::metrics::dead_poison();
                        dead.push((id, format!("undecodable row: {e}")));
                    }
                },
            }
        }
        let out = Outcomes {
            dead,
            ..Outcomes::default()
        };
        if !self
            .record_in_turn(recording, &out, parked, shutdown)
            .await?
        {
            return Ok(false);
        }
        let looked_up: HashSet<&str> = item_keys.iter().map(String::as_str).collect();
        if messages
            .iter()
            .any(|m| !looked_up.contains(order_key(m).as_str()))
        {
            // Replayed rows, read back from the table: their keys too.
            let keys: Vec<String> = messages.iter().map(order_key).collect();
            let Some(again) = self.wait_visible(&[], &keys, parked, shutdown).await? else {
                return Ok(false);
            };
            checked = again;
        }
        if state.catching_up && !messages.is_empty() {
            let pending = self.still_pending(&messages).await?;
            let before = messages.len();
            messages.retain(|m| pending.contains(&m.id));
            if messages.len() == before {
                state.catching_up = false;
            } else {
                info!(
                    skipped = before - messages.len(),
                    "skipped rows the previous session published and recorded already"
                );
            }
        }
        outboxkit_core::metrics::claimed(messages.len());
        let keys: Vec<String> = messages.iter().map(order_key).collect();
        let result = self
            .publish_in_order(
                &messages, &keys, false, &checked, state, parked, recording, shutdown,
            )
            .await;
        if !matches!(result, Ok(true)) {
            // Every message of a batch that ended is left (the recording in flight
            // leaves its own); of one that did not, none is in the stream any more.
            parked.clear_stream();
        }
        result
    }

    /// Publishes `messages` (of `keys`) in order, parking what cannot go now (see
    /// `park`; judged by `checked`), pausing the whole stream only for a broker
    /// outage. `entered`: the messages were registered in the stream already (see
    /// `Parked::enter_stream`), when a pipeline's batches go again after an outage.
    #[allow(clippy::too_many_arguments)] // reason: the stream's state, passed down
    async fn publish_in_order(
        &self,
        messages: &[OutboxMessage],
        keys: &[String],
        entered: bool,
        checked: &Checked,
        state: &mut SessionStart,
        parked: &Arc<Parked>,
        recording: &mut Recording,
        shutdown: &CancellationToken,
    ) -> Result<bool, WalError> {
        // The crash-loop guard: the session's first pending message is the one a
        // relay that died publishing alone left behind (see `SessionStart`).
        let mut guarded = None;
        let mut skip_first = false;
        if !state.guarded && !messages.is_empty() {
            // Counted only once the broker can take it: a relay restarted while the
            // broker is down or frozen would otherwise count the message, then hang
            // publishing it until killed again (the polling relay claims nothing
            // before its publisher is ready, for the same reason).
            if let Err(e) = self.broker_ready().await
                && !self
                    .wait_for_broker(
                        &e.to_string(),
                        messages.len(),
                        &mut Duration::from_millis(500),
                        shutdown,
                    )
                    .await?
            {
                return Ok(false);
            }
            state.guarded = true;
            let first = &messages[0];
            let alone = self.bump_alone(first.id).await?;
            if alone > i64::from(self.config.crash_loop_limit) {
                let times = alone - 1;
                warn!(id = %first.id, event_type = %first.event_type, times, "suspected crash loop: the relay ended every time it published this message alone; it is dead");
                outboxkit_core::metrics::dead(&first.event_type);
                let error = format!(
                    "suspected crash loop: published alone {times} times without an outcome (the relay ended each time)"
                );
                let out = Outcomes {
                    dead: vec![(first.id, error)],
                    ..Outcomes::default()
                };
                if !self
                    .record_in_turn(recording, &out, parked, shutdown)
                    .await?
                {
                    return Ok(false);
                }
                skip_first = true;
            } else {
                guarded = Some(first.id);
            }
        }
        // Indices of the messages still to handle, in order.
        let mut todo: VecDeque<usize> = (usize::from(skip_first)..messages.len()).collect();
        let mut outage_delay = Duration::from_millis(500);
        let mut entered: HashSet<usize> = if entered {
            (0..messages.len()).collect()
        } else {
            HashSet::new()
        };
        while !todo.is_empty() {
            // While careful, small rounds each recorded before the next (see
            // `SessionStart`).
            let careful = state.careful_left > 0;
            let n = if careful {
                todo.len().min(state.careful_chunk)
            } else {
                todo.len()
            };
            let round: Vec<usize> = todo.drain(..n).collect();
            let mut out = Outcomes::default();
            // What may go now; the rest is parked. (After an outage met in an earlier
            // round, `checked.now` is older: a message that came due meanwhile is
            // parked, never published early.)
            let mut go = Vec::with_capacity(round.len());
            // Messages that went in an earlier round, met an outage and are parked now:
            // their keys leave the stream with this round's record.
            let mut stranded = Vec::new();
            for &i in &round {
                match hold(&*self.publisher, &messages[i], &keys[i], parked, checked) {
                    None => go.push(i),
                    Some(row) => {
                        if entered.contains(&i) {
                            stranded.push(i);
                        }
                        out.parked.push(row);
                    }
                }
            }
            // The sweeper leaves the keys of what goes alone until it is recorded: a
            // later message of such a key may be parked in this round.
            parked.enter_stream(
                go.iter()
                    .filter(|i| entered.insert(**i))
                    .map(|&i| keys[i].as_str()),
            );
            let owned: Vec<OutboxMessage>;
            let contiguous =
                go.len() == round.len() && round[round.len() - 1] - round[0] + 1 == round.len();
            let slice: &[OutboxMessage] = if contiguous {
                &messages[round[0]..=round[round.len() - 1]]
            } else {
                owned = go.iter().map(|&i| messages[i].clone()).collect();
                &owned
            };
            let mut done = go.len();
            let mut outage = None;
            if !slice.is_empty() {
                let slice_keys: Vec<&str> = go.iter().map(|&i| keys[i].as_str()).collect();
                let outcomes = self.publish_keyed(slice, &slice_keys).await;
                // Keys with a message parked by a failure in this round: their later
                // messages are parked behind it, even when the broker took them
                // (published again after it: a duplicate, never a reordering).
                let mut failed: HashSet<&str> = HashSet::new();
                for (j, (&i, outcome)) in go.iter().zip(outcomes).enumerate() {
                    let (m, key) = (&messages[i], keys[i].as_str());
                    if failed.contains(key) {
                        parked.park_key(key);
                        out.parked.push(ParkedRow::behind(m.id, key));
                        continue;
                    }
                    match self.judge(m, key, outcome, parked, &mut out) {
                        Judged::Done => {}
                        Judged::Parked => {
                            failed.insert(key);
                        }
                        Judged::Outage(reason) => {
                            outage = Some(reason);
                            done = j;
                            break;
                        }
                    }
                }
                outboxkit_core::metrics::commit_to_publish(
                    slice
                        .iter()
                        .map(|m| (&m.created_at, out.sent.contains(&m.id))),
                );
            }
            if !recording.settle().await? {
                return Ok(false);
            }
            if !careful && todo.is_empty() && outage.is_none() && guarded.is_none() {
                // The batch's last round, nothing to do after it: recorded in the
                // background (the messages leave the stream once it is).
                let left = go
                    .iter()
                    .chain(&stranded)
                    .map(|&i| keys[i].clone())
                    .collect();
                recording.start(
                    self.recorder(),
                    out,
                    left,
                    Arc::clone(parked),
                    shutdown.clone(),
                );
            } else {
                if !self.record(&out, Whose::Pending, parked, shutdown).await? {
                    return Ok(false);
                }
                parked.leave_stream(
                    go[..done]
                        .iter()
                        .chain(&stranded)
                        .map(|&i| keys[i].as_str()),
                );
            }
            // What the broker did not take because of an outage goes again first.
            for &i in go[done..].iter().rev() {
                todo.push_front(i);
            }
            let handled = round.len() - (go.len() - done);
            if state.careful_left > 0 && handled > 0 {
                state.careful_left = state.careful_left.saturating_sub(handled);
                // 1, 1, 2, 4, ...: the first message alone, then doubling rounds.
                if !std::mem::replace(&mut state.careful_first_done, true) {
                    state.careful_chunk = 1;
                } else {
                    state.careful_chunk = (state.careful_chunk * 2).min(self.config.batch_size);
                }
            }
            if let Some(id) = guarded.take() {
                // The publish of the guarded message came back: whatever it was (an
                // outage too), the relay did not die of it.
                self.reset_alone(id).await?;
            }
            let Some(reason) = outage else {
                self.broker_back();
                continue;
            };
            if !self
                .wait_for_broker(&reason, todo.len(), &mut outage_delay, shutdown)
                .await?
            {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Judges the outcome of `m`'s publish into `out`: sent, dead, or parked (its
    /// key's later messages are then parked behind it), or an outage (nothing
    /// recorded: the message goes again after the probe).
    fn judge(
        &self,
        m: &OutboxMessage,
        key: &str,
        outcome: Option<PublishOutcome>,
        parked: &Parked,
        out: &mut Outcomes,
    ) -> Judged {
        match outcome {
            Some(PublishOutcome::Published) => out.sent.push(m.id),
            Some(PublishOutcome::Permanent(e)) => dead_for_good(m, &e, out),
            Some(o) if o.is_refused_by_destination() => {
                let circuit = self.circuit(m.routing_key.as_deref(), &m.event_type);
                out.parked.push(parked.refusal(m, &circuit, key, &o));
                parked.park_key(key);
                return Judged::Parked;
            }
            Some(PublishOutcome::Transient(e)) if e.kind() != ErrorKind::Unavailable => {
                if let Some(p) = self.retry_or_dead(m, key, &e, out) {
                    parked.park_key(key);
                    out.parked.push(p);
                    return Judged::Parked;
                }
            }
            Some(o) => return Judged::Outage(outcome_text(&o)),
            None => return Judged::Outage("the publisher gave no outcome".to_owned()),
        }
        Judged::Done
    }

    /// The broker took a batch: an open circuit closes.
    fn broker_back(&self) {
        if self.counters.circuit_open.swap(false, Ordering::Relaxed) {
            info!("the broker takes messages again; reading resumes");
            metrics::gauge!(outboxkit_core::metrics::CIRCUIT_OPEN).set(0.0);
        }
    }

    /// Whether the publisher is ready ([`check_ready`](EventPublisher::check_ready)),
    /// given up after its publish timeout (15 s when it states none): a broker that
    /// accepts connections and answers nothing is not ready.
    async fn broker_ready(&self) -> Result<(), PublishError> {
        let limit = self
            .publisher
            .publish_timeout()
            .unwrap_or(Duration::from_secs(15));
        tokio::time::timeout(limit, self.publisher.check_ready())
            .await
            .unwrap_or(Err(PublishError::Timeout(limit)))
    }

    /// A broker outage (`reason`, with `unconfirmed` messages waiting): the circuit
    /// opens and the stream pauses until the broker is ready again. `Ok(false)`:
    /// shutdown came first.
    async fn wait_for_broker(
        &self,
        reason: &str,
        unconfirmed: usize,
        outage_delay: &mut Duration,
        shutdown: &CancellationToken,
    ) -> Result<bool, WalError> {
        if !self.counters.circuit_open.swap(true, Ordering::Relaxed) {
            warn!(error = %reason, unconfirmed, "the broker cannot take messages: reading pauses, nothing is charged");
            metrics::gauge!(outboxkit_core::metrics::CIRCUIT_OPEN).set(1.0);
        }
        let mut delay = *outage_delay;
        *outage_delay = outboxkit_core::retry::outage_backoff(delay, self.config.probe_cap);
        // During an outage: probe until the broker is ready, then publish the rest
        // of the batch again. The session stays open meanwhile, and a PostgreSQL
        // shutting down waits for this session to confirm what it was sent: so
        // each probe first checks the database, and an unreachable one ends the
        // session (see `record`).
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return Ok(false),
                () = tokio::time::sleep(delay) => {}
            }
            sqlx::query("SELECT 1")
                .execute(self.outbox.pool())
                .await
                .map_err(crate::error::db("wal database check"))?;
            if self.broker_ready().await.is_ok() {
                return Ok(true);
            }
            delay = *outage_delay;
            *outage_delay = outboxkit_core::retry::outage_backoff(delay, self.config.probe_cap);
        }
    }

    /// Publishes `messages` (of `keys`) by a task of their own, as the pipeline's
    /// newest batch (see `pipeline`), holding back (parking) what cannot go now (by
    /// `checked`); `upto`: the stream's position after the batch.
    fn launch(
        &self,
        messages: Vec<OutboxMessage>,
        keys: Vec<String>,
        parked: &Parked,
        pipeline: &mut Pipeline,
        upto: Option<Lsn>,
        checked: &Checked,
    ) {
        let mut held = Vec::new();
        let mut go = Vec::with_capacity(messages.len());
        let mut go_keys = Vec::with_capacity(keys.len());
        for (m, key) in messages.into_iter().zip(keys) {
            match hold(&*self.publisher, &m, &key, parked, checked) {
                None => {
                    go.push(m);
                    go_keys.push(key);
                }
                Some(row) => held.push(row),
            }
        }
        parked.enter_stream(go_keys.iter().map(String::as_str));
        let go: Arc<[OutboxMessage]> = go.into();
        let go_keys: Arc<[String]> = go_keys.into();
        let task = if go.is_empty() {
            tokio::spawn(async { Vec::new() })
        } else {
            let (publisher, per_key) = (Arc::clone(&self.publisher), self.config.per_key());
            let (messages, keys) = (Arc::clone(&go), Arc::clone(&go_keys));
            tokio::spawn(async move {
                let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
                publish_keyed(&*publisher, per_key, &messages, &keys).await
            })
        };
        pipeline.push(go, go_keys, held, upto, task);
    }

    /// Handles the outcomes of the pipeline's oldest `batch` (just landed) and records
    /// them in the background, the batch's position confirmed after. An outage puts
    /// its unconfirmed messages and every later batch's back, behind the probe.
    /// `Ok(false)`: shutdown came during the outage or a recording.
    #[allow(clippy::too_many_arguments)] // reason: the stream's state, passed down
    pub(super) async fn land(
        &self,
        batch: InFlight,
        outcomes: Vec<Option<PublishOutcome>>,
        pipeline: &mut Pipeline,
        state: &mut SessionStart,
        parked: &Arc<Parked>,
        recording: &mut Recording,
        shutdown: &CancellationToken,
    ) -> Result<bool, WalError> {
        let mut out = Outcomes {
            parked: batch.held,
            ..Outcomes::default()
        };
        let mut outage = None;
        let mut done = batch.messages.len();
        for (j, outcome) in outcomes.into_iter().enumerate() {
            let (m, key) = (&batch.messages[j], batch.keys[j].as_str());
            if pipeline.parks_behind(key, batch.seq) {
                parked.park_key(key);
                out.parked.push(ParkedRow::behind(m.id, key));
                continue;
            }
            match self.judge(m, key, outcome, parked, &mut out) {
                Judged::Done => {}
                Judged::Parked => pipeline.failed(key),
                Judged::Outage(reason) => {
                    outage = Some(reason);
                    done = j;
                    break;
                }
            }
        }
        outboxkit_core::metrics::commit_to_publish(
            batch
                .messages
                .iter()
                .map(|m| (&m.created_at, out.sent.contains(&m.id))),
        );
        let Some(reason) = outage else {
            pipeline.handled();
            self.broker_back();
            // Queued behind the recording in flight, if any: batches landing faster
            // than PostgreSQL commits are recorded together.
            recording.start(
                self.recorder(),
                out,
                batch.keys.to_vec(),
                Arc::clone(parked),
                shutdown.clone(),
            );
            recording.holds(batch.upto);
            return Ok(true);
        };
        // The outage: this batch's messages from the first without an outcome on, and
        // every later batch's, go again in order once the broker is back (those the
        // broker took meanwhile: duplicates, as within a batch).
        let later = pipeline.take_all();
        let mut upto = batch.upto;
        let mut messages: Vec<OutboxMessage> = batch.messages[done..].to_vec();
        let mut keys: Vec<String> = batch.keys[done..].to_vec();
        for b in later {
            upto = b.upto.or(upto);
            messages.extend(b.messages.iter().cloned());
            keys.extend(b.keys.iter().cloned());
            out.parked.extend(b.held.iter().cloned());
            b.abandon().await;
        }
        let result = async {
            if !self
                .record_in_turn(recording, &out, parked, shutdown)
                .await?
            {
                return Ok(false);
            }
            parked.leave_stream(batch.keys[..done].iter().map(String::as_str));
            let mut delay = Duration::from_millis(500);
            if !self
                .wait_for_broker(&reason, messages.len(), &mut delay, shutdown)
                .await?
            {
                return Ok(false);
            }
            // Judged afresh: keys parked and time passed since they were launched.
            let Some(checked) = self.wait_visible(&[], &keys, parked, shutdown).await? else {
                return Ok(false);
            };
            self.publish_in_order(
                &messages, &keys, true, &checked, state, parked, recording, shutdown,
            )
            .await
        }
        .await;
        if !matches!(result, Ok(true)) {
            parked.clear_stream();
            return result;
        }
        recording.after(upto);
        Ok(true)
    }

    /// Handles every batch in flight, oldest first. `Ok(false)`: as [`land`](Self::land).
    pub(super) async fn drain(
        &self,
        pipeline: &mut Pipeline,
        state: &mut SessionStart,
        parked: &Arc<Parked>,
        recording: &mut Recording,
        shutdown: &CancellationToken,
    ) -> Result<bool, WalError> {
        while !pipeline.is_empty() {
            if !self
                .land_next(pipeline, state, parked, recording, shutdown)
                .await?
            {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Waits for the oldest batch in flight to come back and handles it ([`land`](Self::land)).
    pub(super) async fn land_next(
        &self,
        pipeline: &mut Pipeline,
        state: &mut SessionStart,
        parked: &Arc<Parked>,
        recording: &mut Recording,
        shutdown: &CancellationToken,
    ) -> Result<bool, WalError> {
        let (batch, outcomes) = pipeline.landed().await;
        self.land(
            batch, outcomes, pipeline, state, parked, recording, shutdown,
        )
        .await
    }
}

/// What [`WalRelay::judge`] made of an outcome.
enum Judged {
    /// Sent or dead.
    Done,
    /// Parked: its key's later messages are parked behind it.
    Parked,
    /// A broker outage: nothing recorded.
    Outage(String),
}

/// Whether `m` (of ordering `key`) is held back now: behind its key's parked rows,
/// delayed (its `visible_at` after the database's `now()` read with the batch;
/// `lease_until` is never before `visible_at`), or for a destination whose circuit is
/// open (it waits for the circuit's trial). Then its key counts one more parked row and
/// the row to park is returned.
fn hold<P: EventPublisher>(
    publisher: &P,
    m: &OutboxMessage,
    key: &str,
    parked: &Parked,
    checked: &Checked,
) -> Option<ParkedRow> {
    let row = if parked.key_waits(key, &checked.waiting) || m.visible_at > checked.now {
        ParkedRow::behind(m.id, key)
    } else if !parked.any_open() {
        return None;
    } else {
        let circuit = publisher.destination(m.effective_routing_key());
        let delay = match parked.admit(&circuit) {
            Admit::Go => return None,
            Admit::Hold(d) => d,
            Admit::Trial => Duration::ZERO,
        };
        ParkedRow {
            delay,
            error: Some(format!("held back: destination {circuit} refuses messages")),
            held_for: Some(circuit.into_owned()),
            ..ParkedRow::behind(m.id, key)
        }
    };
    parked.park_key(key);
    Some(row)
}

/// Publishes `messages` (of ordering `keys`) through the dispatcher's guard (bounded by
/// the publish timeout, a panic narrowed down to the message that panics alone): one
/// pipelined call, or with per-key order (`per_key`) waves of at most one message per
/// key, a key's later messages not attempted (`None`) after its message failed other
/// than for good, and nothing more after an outage.
pub(super) async fn publish_keyed<P: EventPublisher>(
    publisher: &P,
    per_key: bool,
    messages: &[OutboxMessage],
    keys: &[&str],
) -> Vec<Option<PublishOutcome>> {
    let began = Instant::now();
    let deadline = || publisher.publish_timeout().map(|t| Instant::now() + t);
    let distinct = || keys.iter().collect::<HashSet<_>>().len() == keys.len();
    if !per_key || distinct() {
        let outcomes =
            outboxkit_core::dispatcher::publish_guarded(publisher, messages, deadline()).await;
        outboxkit_core::metrics::publish_duration(began.elapsed());
        return outcomes;
    }
    let mut outcomes: Vec<Option<PublishOutcome>> = messages.iter().map(|_| None).collect();
    let mut remaining: Vec<usize> = (0..messages.len()).collect();
    let mut failed: HashSet<&str> = HashSet::new();
    while !remaining.is_empty() {
        let mut in_wave: HashSet<&str> = HashSet::new();
        let (wave, rest): (Vec<usize>, Vec<usize>) = remaining
            .iter()
            .filter(|&&i| !failed.contains(keys[i]))
            .partition(|&&i| in_wave.insert(keys[i]));
        if wave.is_empty() {
            break;
        }
        let batch: Vec<OutboxMessage> = wave.iter().map(|&i| messages[i].clone()).collect();
        let mut stop = false;
        let wave_outcomes =
            outboxkit_core::dispatcher::publish_guarded(publisher, &batch, deadline()).await;
        for (&i, outcome) in wave.iter().zip(wave_outcomes) {
            match &outcome {
                Some(PublishOutcome::Published | PublishOutcome::Permanent(_)) => {}
                Some(o) if !o.is_outage() => {
                    failed.insert(keys[i]);
                }
                _ => stop = true,
            }
            outcomes[i] = outcome;
        }
        if stop {
            break;
        }
        remaining = rest;
    }
    outboxkit_core::metrics::publish_duration(began.elapsed());
    outcomes
}
