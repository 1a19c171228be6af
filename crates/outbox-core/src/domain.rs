//! Domain events: an aggregate collects the events it raises in a [`DomainEvents`] list,
//! and the backend's `save_events` drains that list into the outbox inside the caller's
//! transaction (the classic save-changes interceptor), so an event is written once.

use crate::message::NewMessage;

/// Events raised by an aggregate and not yet written to the outbox.
#[derive(Debug, Default, Clone)]
pub struct DomainEvents {
    pending: Vec<NewMessage>,
}

impl DomainEvents {
    /// An empty list.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records an event raised by the aggregate.
    pub fn raise(&mut self, event: NewMessage) {
        self.pending.push(event);
    }

    /// Events waiting to be written, in the order raised.
    pub fn pending(&self) -> &[NewMessage] {
        &self.pending
    }

    /// Removes and returns every pending event. Backends call this when they write the
    /// events; after it, the same events can no longer be written twice.
    pub fn take(&mut self) -> Vec<NewMessage> {
        std::mem::take(&mut self.pending)
    }

    /// Puts events back in front of any raised since (used when a write failed, so the
    /// caller can retry the whole unit of work with its events intact).
    pub fn restore(&mut self, mut events: Vec<NewMessage>) {
        events.append(&mut self.pending);
        self.pending = events;
    }
}

/// An aggregate (or any unit of work) that raises domain events.
pub trait EventSource {
    /// The aggregate's pending events.
    fn domain_events(&mut self) -> &mut DomainEvents;
}

impl EventSource for DomainEvents {
    fn domain_events(&mut self) -> &mut DomainEvents {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(n: i64) -> NewMessage {
        NewMessage::builder("order", "1", "OrderPlaced")
            .aggregate_version(n)
            .payload(&n)
            .build()
            .expect("valid")
    }

    #[test]
    fn take_drains_and_restore_keeps_order() {
        let mut events = DomainEvents::new();
        events.raise(event(1));
        events.raise(event(2));
        let taken = events.take();
        assert_eq!(taken.len(), 2);
        assert!(events.pending().is_empty());
        events.raise(event(3));
        events.restore(taken);
        let versions: Vec<i64> = events
            .pending()
            .iter()
            .map(|e| e.aggregate_version)
            .collect();
        assert_eq!(versions, [1, 2, 3]);
    }
}
