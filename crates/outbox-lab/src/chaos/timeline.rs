//! What happened when: every fault injected (with its window) or not injected (with
//! why), printed as it happens and kept for the verdict.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use chrono::{DateTime, Utc};

use super::schedule::FaultKind;

/// One fault as it happened.
#[derive(Debug, Clone)]
pub(crate) struct Record {
    pub(crate) kind: FaultKind,
    /// Injected (`false`: it could not be, see `note`).
    pub(crate) injected: bool,
    /// When it was injected.
    pub(crate) start: DateTime<Utc>,
    /// When it was undone (the process started again, the server back); `None` while
    /// it lasts, or for a fault that is over at once.
    pub(crate) end: Option<DateTime<Utc>>,
    /// What it hit, or why it was not injected.
    pub(crate) note: String,
    /// When it was surely in force: from when its injection completed until its undo
    /// began (a server fault's `start` is when its injection began; `end` when its undo
    /// completed). `None` for a fault recorded otherwise.
    pub(crate) in_force: Option<(DateTime<Utc>, DateTime<Utc>)>,
}

/// The shared record of a run, with the run's start for relative times.
#[derive(Debug, Clone)]
pub(crate) struct Timeline {
    started: Instant,
    records: Arc<Mutex<Vec<Record>>>,
}

impl Timeline {
    pub(crate) fn new() -> Self {
        Self {
            started: Instant::now(),
            records: Arc::new(Mutex::new(Vec::new())),
        }
    }

    /// Seconds since the start of the run, for log lines.
    pub(crate) fn offset(&self) -> String {
        format!("{:>7.1}s", self.started.elapsed().as_secs_f64())
    }

    /// Prints a line of the run's log.
    pub(crate) fn say(&self, line: impl AsRef<str>) {
        println!("[{}] {}", self.offset(), line.as_ref());
    }

    /// Records a fault injected now; returns its index for [`ended`](Self::ended).
    pub(crate) fn injected(&self, kind: FaultKind, note: impl Into<String>) -> usize {
        self.injected_since(kind, note, Utc::now())
    }

    /// Records a fault in force since `start` (when its injection began: a server
    /// being stopped refuses connections from the start of its shutdown, which can take
    /// seconds); returns its index for [`ended`](Self::ended).
    pub(crate) fn injected_since(
        &self,
        kind: FaultKind,
        note: impl Into<String>,
        start: DateTime<Utc>,
    ) -> usize {
        self.push(Record {
            kind,
            injected: true,
            start,
            end: None,
            in_force: None,
            note: note.into(),
        })
    }

    /// Records a fault that could not be injected, and why.
    pub(crate) fn not_injected(&self, kind: FaultKind, why: impl Into<String>) {
        let why = why.into();
        self.say(format!("NOT injected: {kind:?}: {why}"));
        self.push(Record {
            kind,
            injected: false,
            start: Utc::now(),
            end: None,
            in_force: None,
            note: why,
        });
    }

    /// Marks fault `index` as undone now.
    pub(crate) fn ended(&self, index: usize) {
        if let Ok(mut records) = self.records.lock()
            && let Some(r) = records.get_mut(index)
        {
            r.end = Some(Utc::now());
        }
    }

    /// Records that fault `index` was surely in force from `from` until `until` (see
    /// [`Record::in_force`]).
    pub(crate) fn in_force(&self, index: usize, from: DateTime<Utc>, until: DateTime<Utc>) {
        if let Ok(mut records) = self.records.lock()
            && let Some(r) = records.get_mut(index)
        {
            r.in_force = Some((from, until));
        }
    }

    fn push(&self, record: Record) -> usize {
        let mut records = self.records.lock().expect("timeline lock poisoned");
        records.push(record);
        records.len() - 1
    }

    /// Every record so far.
    pub(crate) fn records(&self) -> Vec<Record> {
        self.records.lock().map(|r| r.clone()).unwrap_or_default()
    }
}
