//! Per-unit `backward` tracing spans (`cpl train --trace`). candle runs a graph's backward as one
//! call, so a unit's backward has no scope a span could wrap. While a tracing subscriber records,
//! [`super::Unit::forward`] passes the unit's input and output through identity nodes: backward
//! reaches the output's node before any node of the unit and enters a `backward` span named by
//! the unit there, and reaches the input's node after every node of the unit and exits it there.
//! With no subscriber recording, nothing is added to the graph.
//!
//! candle's backward runs on the thread that called it, so the open spans live in a
//! thread-local map keyed by a per-call id.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::Tensor;
use tracing::span::EnteredSpan;

use crate::error::Result;

thread_local! {
    static OPEN: RefCell<HashMap<u64, EnteredSpan>> = RefCell::new(HashMap::new());
}

static NEXT: AtomicU64 = AtomicU64::new(0);

/// Wraps a unit's call: `x` through the node that closes the span (run `forward` on what this
/// returns), then the output through the node that opens it. `x` must track gradients.
pub(crate) fn around(
    unit: String,
    x: &Tensor,
    forward: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    let x = crate::collectives::record(
        x,
        "cpl-backward-span-end",
        |x| Ok(x.clone()),
        move |g| {
            OPEN.with(|o| o.borrow_mut().remove(&id));
            Ok(g.clone())
        },
    )?;
    let y = forward(&x)?;
    Ok(crate::collectives::record(
        &y,
        "cpl-backward-span-begin",
        |y| Ok(y.clone()),
        move |g| {
            let span = tracing::info_span!("backward", unit = %unit).entered();
            OPEN.with(|o| o.borrow_mut().insert(id, span));
            Ok(g.clone())
        },
    )?)
}
