//! The outboxkit-core inbox conformance suite, run against [`MemoryInbox`] (claims, consumer
//! dead letters and version tracking; it has no durable inbox).

use std::sync::Arc;

use outboxkit_core::inbox_conformance::InboxHarness;
use outboxkit_memory::{MemoryInbox, MemoryOutbox};

/// A fresh inbox per test.
struct MemoryInboxHarness(Arc<MemoryInbox>);

impl InboxHarness for MemoryInboxHarness {
    type Inbox = MemoryInbox;

    fn inbox(&self) -> Arc<MemoryInbox> {
        Arc::clone(&self.0)
    }
}

async fn harness() -> MemoryInboxHarness {
    MemoryInboxHarness(Arc::new(MemoryOutbox::new().inbox()))
}

outboxkit_core::inbox_conformance_tests!(harness; dead_letters, versions);
