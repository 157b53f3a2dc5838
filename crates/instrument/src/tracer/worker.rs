//! Summarising op outputs off the forward pass's thread.
//!
//! With a worker ([`crate::tracer::Tracer::with_summary_worker`]) the tracer hands each CPU op
//! output, with its record still lacking the summary, to one thread through a bounded queue, and
//! the forward pass runs on while that thread summarises it ([`crate::digest::summarize_op`])
//! and pushes the record into the sink. A candle tensor is immutable once produced (the
//! instrumented models build their KV cache by concatenation, never write into a tensor in
//! place), so the worker reads exactly what the op produced. Holding a tensor keeps its storage
//! alive until it is summarised: at most [`QUEUE`] ops wait, and the tensors waiting or being
//! summarised hold at most [`HELD_BYTES`] (counted as their elements' bytes; one larger tensor
//! is taken alone).
//!
//! Every other item, and the sink's other calls (end of a forward pass, sampling records, the
//! footer), go through the same queue, so the sink sees the same calls in the same order as on the
//! synchronous path: the same trace file, byte for byte. An error (I/O, or candle's while
//! summarising, or a panic there) stops the worker pushing: it drops the items queued after the one
//! that failed, but still ends the forward passes queued (so what was recorded before the error is
//! written, as on the synchronous path, where the recorder ends the pass after an error), and hands
//! the sink back. The tracer returns the error at its next call, and from then on only ends forward
//! passes (on the sink itself): every other call returns the error. Dropping the worker lets it
//! empty the queue first.

use crate::digest::{summarize_op, Rows, TokenAxis};
use crate::tracer::Sink;
use candle_core::Tensor;
use candle_trace_format::error::{Error, Result};
use candle_trace_format::record::{Footer, Item, OpRecord};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// Jobs the queue holds at most: a full queue makes the forward pass wait for the worker.
pub const QUEUE: usize = 64;

/// Bytes of op outputs queued or being summarised, at most (64 MiB): past it the forward pass
/// waits.
pub const HELD_BYTES: usize = 64 << 20;

/// An op record whose digest, statistics, samples and per-token statistics are still to be
/// made from `t` (the op's output, any shape and dtype `summarize_op` takes).
pub struct Pending {
    /// The record, summary fields empty.
    pub rec: OpRecord,
    /// The op's output.
    pub t: Tensor,
    /// Its token axis, as the tracer worked it out.
    pub axis: Option<TokenAxis>,
    /// The batch rows' windows when the record was made.
    pub rows: Rows,
    /// The op (its masked keys may count: [`crate::digest::masked`]).
    pub op: candle_trace_format::site::Op,
}

/// A call on the sink, made on the worker.
type Call = Box<dyn FnOnce(&mut dyn Sink) -> Result<()> + Send>;

enum Job {
    Item(Box<Item>),
    /// The op, and the bytes [`Held`] counts for it.
    Op(Box<Pending>, usize),
    /// A call, and whether it is made after an error too (ending a forward pass).
    Call(Call, bool),
}

/// The first recorded output holding a NaN or ±Inf that counts: module path and forward pass.
pub type NonFinite = Option<(String, u32)>;

/// What the thread gives back: how it ended, and the sink.
type Ended = (Result<()>, Box<dyn Sink>);

/// The summarising thread and the queue into it. See the module docs.
pub struct Worker {
    tx: Option<SyncSender<Job>>,
    thread: Option<JoinHandle<Ended>>,
    nonfinite: Arc<Mutex<NonFinite>>,
    held: Arc<Held>,
    /// The sink, once the thread has ended and given it back.
    returned: Option<Box<dyn Sink>>,
}

/// Bytes of queued op outputs and whether the thread still takes jobs; whether it has failed.
struct Held {
    state: Mutex<(usize, bool)>,
    freed: Condvar,
    failed: AtomicBool,
}

impl Held {
    /// Waits until `bytes` more fit under [`HELD_BYTES`] (or nothing is held, or the thread
    /// has ended), then counts them.
    fn enter(&self, bytes: usize) {
        let Ok(mut g) = self.state.lock() else { return };
        while g.1 && g.0 > 0 && g.0 + bytes > HELD_BYTES {
            match self.freed.wait(g) {
                Ok(next) => g = next,
                Err(_) => return,
            }
        }
        g.0 += bytes;
    }

    /// Uncounts `bytes` (summarised, or dropped after an error).
    fn leave(&self, bytes: usize) {
        if let Ok(mut g) = self.state.lock() {
            g.0 = g.0.saturating_sub(bytes);
        }
        self.freed.notify_all();
    }

    /// The thread has ended: no sender waits for it any more.
    fn close(&self) {
        if let Ok(mut g) = self.state.lock() {
            g.1 = false;
        }
        self.freed.notify_all();
    }
}

/// Closes [`Held`] when the thread ends, by returning or by panicking.
struct Closing(Arc<Held>);
impl Drop for Closing {
    fn drop(&mut self) {
        self.0.close();
    }
}

impl Worker {
    /// Starts the thread, which owns `sink` until it ends.
    ///
    /// # Errors
    /// [`Error::Io`] when the thread cannot be started.
    pub fn start(sink: Box<dyn Sink>) -> Result<Worker> {
        let (tx, rx) = sync_channel(QUEUE);
        let nonfinite = Arc::new(Mutex::new(None));
        let held = Arc::new(Held { state: Mutex::new((0, true)), freed: Condvar::new(), failed: AtomicBool::new(false) });
        let (seen, counted) = (nonfinite.clone(), held.clone());
        let thread = std::thread::Builder::new()
            .name("candle-trace-summary".into())
            .spawn(move || {
                let _closing = Closing(counted.clone());
                let mut sink = sink;
                (work(rx, sink.as_mut(), &seen, &counted), sink)
            })
            .map_err(|source| Error::Io { path: "summary worker thread".into(), source })?;
        Ok(Worker { tx: Some(tx), thread: Some(thread), nonfinite, held, returned: None })
    }

    /// Queues `item` for the sink.
    ///
    /// # Errors
    /// The error that ended the worker, if it has ended.
    pub fn push(&mut self, item: Item) -> Result<()> {
        self.send(Job::Item(Box::new(item)))
    }

    /// Queues an op record to summarise and push; waits while the outputs queued hold more
    /// than [`HELD_BYTES`].
    ///
    /// # Errors
    /// As [`Worker::push`].
    pub fn op(&mut self, p: Pending) -> Result<()> {
        let bytes = p.t.elem_count() * p.t.dtype().size_in_bytes();
        self.held.enter(bytes);
        self.send(Job::Op(Box::new(p), bytes))
    }

    /// Queues a call on the sink (end of a forward pass, sampling records, level); with
    /// `after_error`, the worker makes it even once an earlier job has failed (its error is
    /// then ignored: the first one is returned).
    ///
    /// # Errors
    /// As [`Worker::push`].
    pub fn call(&mut self, f: impl FnOnce(&mut dyn Sink) -> Result<()> + Send + 'static, after_error: bool) -> Result<()> {
        self.send(Job::Call(Box::new(f), after_error))
    }

    /// Hands the footer to the sink and waits for the worker to finish the queue.
    ///
    /// # Errors
    /// The first error the worker met (I/O, summarising), or the sink's writing the footer.
    pub fn finish(&mut self, footer: &Footer) -> Result<()> {
        let footer = footer.clone();
        self.call(move |s| s.finish(&footer), false)?;
        self.join()
    }

    /// The first output holding a NaN or ±Inf among those the worker has pushed (every one,
    /// once [`Worker::finish`] returned).
    pub fn nonfinite(&self) -> NonFinite {
        self.nonfinite.lock().map(|g| g.clone()).unwrap_or(None)
    }

    /// The sink, once the thread has ended and given it back (after an error: the items it
    /// pushed before the error are in it).
    pub fn take_sink(&mut self) -> Option<Box<dyn Sink>> {
        self.returned.take()
    }

    /// Queues `job`, unless the worker has failed; a call made after an error too is queued
    /// even then (the worker makes it before it ends).
    fn send(&mut self, job: Job) -> Result<()> {
        let always = matches!(job, Job::Call(_, true));
        let failed = self.held.failed.load(Ordering::Acquire);
        let sent = match &self.tx {
            Some(tx) if always || !failed => tx.send(job).is_ok(),
            _ => false,
        };
        if sent && !failed {
            return Ok(());
        }
        // The worker has failed or ended: its error says why.
        self.join()?;
        Err(Error::Candle(candle_core::Error::Msg("the summary worker has stopped".into())))
    }

    /// Closes the queue and waits for the thread: `Ok` once it has emptied the queue.
    fn join(&mut self) -> Result<()> {
        self.tx = None;
        match self.thread.take().map(JoinHandle::join) {
            None => Ok(()),
            Some(Ok((ended, sink))) => {
                self.returned = Some(sink);
                ended
            }
            Some(Err(_)) => Err(Error::Candle(candle_core::Error::Msg("the summary worker panicked".into()))),
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.join();
    }
}

/// The worker's loop: takes jobs in order until the queue closes; returns the first error.
fn work(rx: Receiver<Job>, sink: &mut dyn Sink, first: &Mutex<NonFinite>, held: &Held) -> Result<()> {
    let mut scan = candle_trace_compare::nonfinite::Scan::default();
    let mut failed: Option<Error> = None;
    while let Ok(job) = rx.recv() {
        if failed.is_some() {
            // Drop what is queued after the error; still end the forward passes.
            match job {
                Job::Op(_, bytes) => held.leave(bytes),
                Job::Call(f, true) => drop(f(sink)),
                _ => {}
            }
            continue;
        }
        let item = match job {
            Job::Call(f, _) => f(sink).map(|_| None),
            Job::Item(item) => Ok(Some(*item)),
            Job::Op(p, bytes) => {
                let rec = summarised(*p);
                held.leave(bytes);
                rec.map(|r| Some(Item::Op(r)))
            }
        };
        let done = item.and_then(|item| {
            let Some(item) = item else { return Ok(()) };
            // The first non-finite output, noted once.
            if scan.found.is_none() && scan.feed(&item) {
                if let (Some(n), Ok(mut g)) = (&scan.found, first.lock()) {
                    *g = Some((n.path.to_string(), n.step));
                }
            }
            sink.push(item)
        });
        if let Err(e) = done {
            failed = Some(e);
            held.failed.store(true, Ordering::Release);
        }
    }
    failed.map_or(Ok(()), Err)
}

/// `p`'s record with its summary filled in (the tensor is dropped).
fn summarised(p: Pending) -> Result<OpRecord> {
    let s = caught(p.rec.seq, || Ok(summarize_op(&p.t, p.axis.as_ref(), &p.rows, p.op)?))?;
    Ok(OpRecord { digest: s.digest, stats: s.stats, samples: s.samples, tokens: s.tokens, ..p.rec })
}

/// `f()`, a panic in it (in candle or here) turned into an error naming op record `seq`: the
/// worker then keeps its sink, and what was recorded before reaches the file as after any other
/// error.
fn caught<T>(seq: u64, f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let why = panic.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| panic.downcast_ref::<String>().cloned()).unwrap_or_default();
        Err(Error::Candle(candle_core::Error::Msg(format!("summarising op record {seq} panicked: {why}"))))
    })
}

#[cfg(test)]
mod tests {
    use crate::tracer::{MemorySink, Sink, Tok, Tracer};
    use candle_core::{DType, Device, Tensor};
    use candle_trace_format::error::{Error, Result};
    use candle_trace_format::record::{Footer, Item, Phase, Reads};

    /// Probes three outputs, the second and third holding a NaN, and finishes.
    fn probed(tr: &mut Tracer) -> Result<()> {
        let dev = Device::Cpu;
        tr.begin_forward(Phase::Prefill, 0, &Tensor::new(&[[1u32, 2]], &dev)?)?;
        let x = tr.probe("embed", Tensor::ones((1, 2, 4), DType::F32, &dev)?, &[], Tok::Seq(1))?;
        let nan = Tensor::new(&[[[1f32, f32::NAN], [0.0, 2.0]]], &dev)?;
        let y = tr.probe("layers.0.mlp", nan.clone(), &[(&x, Reads::Same)], Tok::Seq(1))?;
        tr.probe("layers.1.mlp", nan, &[(&y, Reads::Same)], Tok::Seq(1))?;
        tr.end_forward()?;
        tr.finish(&Footer::default())
    }

    #[test]
    fn the_worker_finds_the_first_nonfinite_output_and_keeps_the_items() {
        let (a, b) = (MemorySink::default(), MemorySink::default());
        let mut inline = Tracer::new(Box::new(a.clone()));
        let mut worker = Tracer::new(Box::new(b.clone())).with_summary_worker(true).expect("worker");
        probed(&mut inline).expect("inline");
        probed(&mut worker).expect("worker");
        assert_eq!(worker.first_nonfinite(), Some(("layers.0.mlp".to_string(), 0)));
        assert_eq!(inline.first_nonfinite(), worker.first_nonfinite());
        let (a, b) = (a.items.lock().expect("a").clone(), b.items.lock().expect("b").clone());
        assert_eq!(a.len(), 7, "forward, 3 sites, 3 ops: {a:?}");
        // Compared as text: the NaN samples are unequal to themselves.
        assert_eq!(format!("{a:?}"), format!("{b:?}"));
    }

    #[test]
    fn queued_outputs_hold_at_most_the_byte_budget() {
        use super::{Held, HELD_BYTES};
        use std::sync::{Arc, Condvar, Mutex};
        use std::time::Duration;
        let held = Arc::new(Held { state: Mutex::new((0, true)), freed: Condvar::new(), failed: false.into() });
        held.enter(2 * HELD_BYTES); // one output over the budget waits alone
        held.leave(2 * HELD_BYTES);
        held.enter(HELD_BYTES - 10);
        let waiting = |h: &Arc<Held>| {
            let h = h.clone();
            std::thread::spawn(move || h.enter(100))
        };
        let t = waiting(&held);
        std::thread::sleep(Duration::from_millis(100));
        assert!(!t.is_finished(), "100 more bytes are over the budget");
        held.leave(HELD_BYTES - 10);
        t.join().expect("admitted once the queue emptied");
        held.leave(100);
        held.enter(HELD_BYTES);
        let t = waiting(&held);
        std::thread::sleep(Duration::from_millis(100));
        assert!(!t.is_finished());
        held.close();
        t.join().expect("no sender waits for an ended worker");
    }

    #[test]
    fn outputs_queued_after_an_error_do_not_hold_the_forward_pass() {
        // A failing op, then two outputs of more than half the byte budget each: the second
        // waits for the first to be uncounted, which the failed worker does as it drops it.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut tr = Tracer::new(Box::new(MemorySink::default())).with_summary_worker(true).expect("worker");
            let dev = Device::Cpu;
            let big = || Tensor::zeros((1, 1, super::HELD_BYTES / 8 + 1), DType::F32, &dev).expect("t");
            let mut run = || -> Result<()> {
                tr.begin_forward(Phase::Prefill, 0, &Tensor::new(&[[1u32]], &dev)?)?;
                tr.probe("bad", Tensor::ones((1, 1, 4), DType::F32, &dev)?, &[], Tok::Seq(3))?;
                for i in 0..3 {
                    tr.probe(&format!("layers.{i}.mlp"), big(), &[], Tok::Whole)?;
                }
                tr.finish(&Footer::default())
            };
            let _ = tx.send(run().map_err(|e| e.to_string()));
        });
        let done = rx.recv_timeout(std::time::Duration::from_secs(60)).expect("the forward pass went on");
        assert!(done.expect_err("the error is reported").contains("token axis 3 does not fit"));
    }

    #[test]
    fn a_panic_while_summarising_is_an_error_naming_the_record() {
        let err = super::caught::<()>(7, || panic!("index out of bounds")).expect_err("caught");
        assert!(err.to_string().ends_with("summarising op record 7 panicked: index out of bounds"), "{err}");
        assert_eq!(super::caught(7, || Ok(3)).expect("no panic"), 3);
    }

    /// A sink that refuses the `n`th item.
    struct Refusing(usize);
    impl Sink for Refusing {
        fn push(&mut self, _item: Item) -> Result<()> {
            self.0 = self.0.checked_sub(1).ok_or_else(|| Error::usage("disk full"))?;
            Ok(())
        }
    }

    #[test]
    fn an_error_on_the_worker_is_returned_by_a_later_call() {
        let mut tr = Tracer::new(Box::new(Refusing(3))).with_summary_worker(true).expect("worker");
        let err = probed(&mut tr).expect_err("the sink refused an item");
        assert_eq!(err.to_string(), "disk full");
    }

    #[test]
    fn a_tracer_dropped_before_finishing_leaves_every_item_in_the_sink() {
        let sink = MemorySink::default();
        let mut tr = Tracer::new(Box::new(sink.clone())).with_summary_worker(true).expect("worker");
        let dev = Device::Cpu;
        tr.begin_forward(Phase::Prefill, 0, &Tensor::new(&[[1u32]], &dev).expect("ids")).expect("begin");
        for i in 0..3 * super::QUEUE {
            tr.probe(&format!("layers.{i}.mlp"), Tensor::ones((1, 1, 8), DType::F32, &dev).expect("t"), &[], Tok::Seq(1)).expect("probe");
        }
        drop(tr);
        let items = sink.items.lock().expect("items");
        let ops = items.iter().filter(|i| matches!(i, Item::Op(_))).count();
        assert_eq!(ops, 3 * super::QUEUE);
        assert!(items.iter().all(|i| !matches!(i, Item::Op(r) if r.digest == 0)), "every record summarised");
    }
}
