//! One replication session: reading the stream, gathering batches, confirming the
//! position, and how a session starts (`SessionStart`).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::FutureExt as _;
use outboxkit_core::{EventPublisher, MessageStatus, OutboxMessage};
use pgwire_replication::{Lsn, ReplicationClient, ReplicationEvent};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};
use uuid::Uuid;

use super::WalRelay;
use super::gather::Gathered;
use super::park::Parked;
use super::pipeline::Pipeline;
use super::record::Recording;
use crate::wal::WalError;
use crate::wal::pgoutput::{self, Change, Relation, Row};

/// How long a batch that is not full waits for the stream's next change, when the
/// relay found its changes waiting (it is busy: see `stream`; otherwise the
/// configured `linger`).
const LINGER: Duration = Duration::from_millis(1);

/// How a session starts. A new session (after a crash, a takeover, a restart) reads
/// again from the confirmed position, which trails what its predecessor did:
/// - `catching_up`: rows the table already records (`Sent`, `Dead`) are skipped, until
///   a batch has none of them;
/// - `careful_left`: the first messages are published in small rounds, each recorded
///   before the next: 1, 1, 2, 4, ... up to the batch size (`careful_chunk`). A message
///   that makes the relay die takes its round with it; the next start skips what was
///   recorded and begins with that round, so within a few starts the message is the
///   first pending one, published alone;
/// - `guarded`: that first pending message is counted (`unfinished_alone`) before it
///   is published and uncounted when its publish comes back; past the crash-loop limit
///   it goes `Dead` instead. Restarts during a broker outage never count: it is
///   counted only once the publisher is ready (`check_ready`), as the polling relay
///   claims nothing before.
pub(super) struct SessionStart {
    pub(super) catching_up: bool,
    pub(super) careful_left: usize,
    pub(super) careful_chunk: usize,
    pub(super) careful_first_done: bool,
    pub(super) guarded: bool,
}

impl SessionStart {
    fn new(careful: usize) -> Self {
        Self {
            catching_up: true,
            careful_left: careful,
            careful_chunk: 1,
            careful_first_done: false,
            guarded: false,
        }
    }
}

/// One change of the outbox table to act on, in commit order.
pub(super) enum Item {
    Message(Box<OutboxMessage>),
    /// A row that does not decode: it goes dead.
    Poison {
        id: Uuid,
        reason: String,
    },
    /// A row read again from the table when it is published, and published if it is
    /// `New` then: an update back to `New` (a replayed dead letter), a row updated
    /// after its insert in the same transaction, a row of a large transaction.
    Replay(Uuid),
}

impl Item {
    /// The id of its row.
    pub(super) fn id(&self) -> Uuid {
        match self {
            Self::Message(m) => m.id,
            Self::Poison { id, .. } | Self::Replay(id) => *id,
        }
    }
}

impl<P: EventPublisher> WalRelay<P> {
    /// One replication session from `start`: `Ok` after a graceful stop.
    pub(super) async fn session(
        &self,
        start: Lsn,
        shutdown: &CancellationToken,
    ) -> Result<(), WalError> {
        let cfg = crate::wal::connect::replication_config(&self.config.url, &self.wal, start)?;
        let mut client = ReplicationClient::connect(cfg)
            .await
            .map_err(WalError::Stream)?;
        client.wait_started().await.map_err(WalError::Stream)?;
        self.counters.sessions.fetch_add(1, Ordering::Relaxed);
        self.counters.standby.store(false, Ordering::Relaxed);
        // Parked rows of earlier sessions hold their keys: the stream looks its
        // batches' keys up in the table (see `park`).
        let parked = Arc::new(Parked::new(self.config.probe_cap, self.config.batch_size));
        info!(slot = self.wal.slot(), from = %start, "reading the replication slot");
        // The sweeper of parked rows runs beside the stream and stops after it.
        let stop = CancellationToken::new();
        let sweeper = self.sweep(&parked, &stop);
        tokio::pin!(sweeper);
        let mut sweeper_ended = false;
        let result = {
            let stream = self.stream(&mut client, &parked, shutdown);
            tokio::pin!(stream);
            tokio::select! {
                result = &mut stream => result,
                // (It runs until it is stopped; should it end, the stream goes on.)
                () = &mut sweeper => {
                    sweeper_ended = true;
                    stream.await
                }
            }
        };
        // The stream is over: close the replication connection before waiting for the
        // sweeper's round (bounded by the publish timeout), so that a PostgreSQL
        // shutting down, which waits for this session, is not held up by it.
        drop(client);
        stop.cancel();
        if !sweeper_ended {
            sweeper.await;
        }
        result
    }

    /// Reads the stream until shutdown (`Ok`) or a failure.
    async fn stream(
        &self,
        client: &mut ReplicationClient,
        parked: &Arc<Parked>,
        shutdown: &CancellationToken,
    ) -> Result<(), WalError> {
        let mut relations: HashMap<u32, Relation> = HashMap::new();
        let mut batch = Gathered::new(self.config.part_size);
        // The transaction being received (see `flush`: published only once other
        // sessions can see it).
        let mut xid = 0;
        let mut in_tx = false;
        // End of the last transaction received: once every item before it is handled,
        // the position to confirm.
        let mut last_commit: Option<Lsn> = None;
        let mut start_state = SessionStart::new(self.config.batch_size);
        // Whether the relay has waited for the stream since its last batch went out:
        // if not, changes were waiting for it (the stream delivers faster than the
        // relay publishes) and a batch lingers for more; if so, a batch takes only what
        // has arrived and goes out at once.
        let mut waited = true;
        // When the batch being gathered stops lingering: the configured linger after
        // the end of its first transaction.
        let mut linger_until: Option<tokio::time::Instant> = None;
        // The last batch's outcomes being recorded while the next one is gathered and
        // published: the position is confirmed once they are.
        let mut recording = Recording::default();
        // Batches published and not yet handled (see `pipeline`).
        let mut pipeline = Pipeline::new(self.config.concurrency, self.config.per_key());
        loop {
            // A recording that ended is settled and the outcomes queued behind it go.
            if recording.ended() {
                if !recording.advance().await? {
                    self.finish(client, recording.take_settled()).await;
                    return Ok(());
                }
                if let Some(lsn) = recording.take_settled() {
                    client.update_applied_lsn(lsn);
                }
            }
            // Batches whose publish came back are handled first, oldest first.
            while pipeline.front_finished() {
                // (It has come back: no wait.)
                if !self
                    .land_next(
                        &mut pipeline,
                        &mut start_state,
                        parked,
                        &mut recording,
                        shutdown,
                    )
                    .await?
                {
                    self.finish(client, recording.take_settled()).await;
                    return Ok(());
                }
                if let Some(lsn) = recording.take_settled() {
                    client.update_applied_lsn(lsn);
                }
            }
            let next = if in_tx {
                // Inside a transaction: its other changes and its commit are on their
                // way (pgoutput sends a transaction once it committed). A batch is
                // never published in the middle of one, so that a row updated later in
                // the same transaction goes out as it was committed (see `Update`).
                // A transaction of more rows than a part is held as ids and published
                // in parts after its commit (see `gather`).
                tokio::select! {
                    biased;
                    () = shutdown.cancelled() => {
                        // Unpublished items may precede it: confirm no more than what
                        // was recorded (the batches in flight handled first).
                        let _ = self
                            .drain(&mut pipeline, &mut start_state, parked, &mut recording, shutdown)
                            .await;
                        let _ = recording.settle().await;
                        self.finish(client, recording.take_settled()).await;
                        return Ok(());
                    }
                    ev = client.recv() => Some(ev),
                }
            } else if batch.full(self.config.batch_size) {
                None
            } else if batch.is_empty() {
                // What has arrived already, unless a shutdown or an ended recording
                // goes first (as in the `select!`).
                let first = !shutdown.is_cancelled() && !recording.ended();
                let ready = if first { arrived(client) } else { None };
                if ready.is_some() {
                    ready
                } else {
                    waited |= first;
                    tokio::select! {
                        biased;
                        () = shutdown.cancelled() => {
                            // The graceful drain: the batches in flight handled, the
                            // last outcomes recorded, then the position confirmed.
                            let drained = self
                                .drain(&mut pipeline, &mut start_state, parked, &mut recording, shutdown)
                                .await;
                            let recorded = recording.settle().await;
                            let applied = match (drained, recorded) {
                                (Ok(true), Ok(true)) => last_commit,
                                _ => recording.take_settled(),
                            };
                            self.finish(client, applied).await;
                            return Ok(());
                        }
                        (landed, outcomes) = pipeline.landed(), if !pipeline.is_empty() => {
                            if !self
                                .land(landed, outcomes, &mut pipeline, &mut start_state, parked, &mut recording, shutdown)
                                .await?
                            {
                                self.finish(client, recording.take_settled()).await;
                                return Ok(());
                            }
                            if let Some(lsn) = recording.take_settled() {
                                client.update_applied_lsn(lsn);
                            }
                            continue;
                        }
                        recorded = recording.settle(), if recording.busy() => {
                            if !recorded? {
                                self.finish(client, recording.take_settled()).await;
                                return Ok(());
                            }
                            let settled = recording.take_settled();
                            if pipeline.is_empty() {
                                // Nothing gathered since: everything received is
                                // handled.
                                if let Some(lsn) = last_commit {
                                    client.update_applied_lsn(lsn);
                                }
                            } else if let Some(lsn) = settled {
                                client.update_applied_lsn(lsn);
                            }
                            continue;
                        }
                        ev = client.recv() => Some(ev),
                    }
                }
            } else if !waited {
                // A batch waits this long for the next change before it is published:
                // under load the stream arrives in bursts, and fuller batches cost fewer
                // round trips.
                tokio::time::timeout(LINGER, client.recv()).await.ok()
            } else if !self.config.linger.is_zero() {
                // The relay waited for this batch's first change: the configured
                // linger (fuller batches, less database work per message), a deadline
                // after the batch's first transaction rather than a pause renewed by
                // each change: a steady stream with changes closer together than the
                // linger held the batch until it was full (a 2 ms linger at 500
                // messages/s: p50 9.5 ms, p99 83 ms).
                let until = *linger_until
                    .get_or_insert_with(|| tokio::time::Instant::now() + self.config.linger);
                tokio::time::timeout_at(until, client.recv()).await.ok()
            } else {
                // The relay waited for this batch's first change (a keepalive may have
                // come first): the batch takes what has arrived since (the stream's
                // reader gets one turn to pass on what it is reading) and goes out
                // without a linger, which at a low rate would only add to every
                // message's latency.
                match arrived(client) {
                    Some(ev) => Some(ev),
                    None => {
                        tokio::task::yield_now().await;
                        arrived(client)
                    }
                }
            };
            let Some(event) = next else {
                waited = false;
                linger_until = None;
                let flushed = self
                    .flush_gathered(
                        &mut batch,
                        last_commit,
                        &mut start_state,
                        parked,
                        &mut recording,
                        &mut pipeline,
                        shutdown,
                    )
                    .await?;
                if !flushed {
                    // Stopped during an outage: what was not confirmed is read again by
                    // the next session.
                    self.finish(client, recording.take_settled()).await;
                    return Ok(());
                }
                if let Some(lsn) = recording.take_settled() {
                    client.update_applied_lsn(lsn);
                }
                if !pipeline.is_empty() {
                    // The batches in flight hold their positions.
                } else if recording.busy() {
                    recording.holds(last_commit);
                } else if let Some(lsn) = last_commit {
                    client.update_applied_lsn(lsn);
                }
                continue;
            };
            let event = match event {
                Ok(Some(ev)) => ev,
                Ok(None) => {
                    return Err(WalError::Stream(pgwire_replication::PgWireError::Io(
                        Arc::new(std::io::Error::other("the replication stream ended")),
                    )));
                }
                Err(e) => return Err(WalError::Stream(e)),
            };
            match event {
                ReplicationEvent::Begin { xid: x, .. } => {
                    in_tx = true;
                    xid = x;
                    batch.begin(last_commit);
                }
                ReplicationEvent::Commit { end_lsn, .. } => {
                    in_tx = false;
                    last_commit = Some(end_lsn);
                    if batch.is_empty() && !recording.busy() && pipeline.is_empty() {
                        client.update_applied_lsn(end_lsn);
                    }
                }
                ReplicationEvent::KeepAlive { wal_end, .. } => {
                    // Nothing pending and no transaction open: everything before the
                    // server's position is handled, so confirm it (an idle outbox must
                    // not make the slot retain the WAL of other tables).
                    if batch.is_empty() && !in_tx && !recording.busy() && pipeline.is_empty() {
                        client.update_applied_lsn(wal_end);
                    }
                }
                ReplicationEvent::XLogData { data, .. } => {
                    match pgoutput::decode(&data).map_err(|e| WalError::Malformed(e.to_string()))? {
                        Change::Relation(rel) => {
                            relations.insert(rel.oid, rel);
                        }
                        Change::Insert { oid, tuple } => {
                            if let Some(rel) = self.ours(&relations, oid)?
                                && let Some(item) = insert_item(rel, &tuple)
                            {
                                batch.push(item, xid);
                            }
                        }
                        Change::Update { oid, tuple } => {
                            if let Some(rel) = self.ours(&relations, oid)? {
                                let row = Row::new(rel, &tuple);
                                let Ok(id) = row.id() else { continue };
                                let pending = row.status() == Ok(MessageStatus::New.code());
                                batch.update(id, pending, xid);
                            }
                        }
                        Change::Other => {}
                    }
                }
                ReplicationEvent::Message { .. } | ReplicationEvent::StoppedAt { .. } => {}
            }
        }
    }

    /// The relation of a change if it is this outbox's table, `None` for another table
    /// of the publication. A change of a relation the stream never described is an
    /// error: `pgoutput` sends a `Relation` first, and skipping the row would lose it.
    pub(super) fn ours<'r>(
        &self,
        relations: &'r HashMap<u32, Relation>,
        oid: u32,
    ) -> Result<Option<&'r Relation>, WalError> {
        let rel = relations.get(&oid).ok_or_else(|| {
            WalError::Malformed(format!(
                "a change of relation {oid}, which the stream never described"
            ))
        })?;
        Ok((rel.schema == self.outbox.schema() && rel.name == "outbox_messages").then_some(rel))
    }

    /// Reports `applied` (when given) to the server, waits briefly until it was sent,
    /// and ends the session.
    pub(super) async fn finish(&self, client: &mut ReplicationClient, applied: Option<Lsn>) {
        if let Some(lsn) = applied {
            client.update_applied_lsn(lsn);
            let metrics = client.metrics();
            let deadline = Instant::now() + Duration::from_secs(3);
            while metrics.last_applied_lsn() < lsn && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        if tokio::time::timeout(Duration::from_secs(5), client.shutdown())
            .await
            .is_err()
        {
            warn!("the replication session did not end in time; leaving it");
        }
        info!(slot = self.wal.slot(), "replication session ended");
    }
}

/// The stream's next event if it has arrived, without waiting; `None` also once the
/// stream's reader has ended: `recv` then takes the reader's outcome (the server's
/// error) from its finished task, which a poll dropped half-way would lose.
fn arrived(
    client: &mut ReplicationClient,
) -> Option<Result<Option<ReplicationEvent>, pgwire_replication::PgWireError>> {
    if client.is_running() {
        client.recv().now_or_never()
    } else {
        None
    }
}

/// The item of an inserted row: a message to publish if it is `New`, a poison row if
/// it does not decode (and has a readable id), nothing otherwise.
fn insert_item(rel: &Relation, tuple: &[pgoutput::Value]) -> Option<Item> {
    let row = Row::new(rel, tuple);
    match row.message() {
        Ok(m) if m.status == MessageStatus::New => Some(Item::Message(Box::new(m))),
        Ok(_) => None,
        Err(reason) => match row.id() {
            Ok(id) => Some(Item::Poison { id, reason }),
            Err(e) => {
                error!(reason = %reason, id_error = %e, "an inserted row without a readable id: skipped");
                None
            }
        },
    }
}
