//! Summarising op outputs off the forward pass's thread.
//!
//! With a worker ([`crate::tracer::Tracer::with_summary_worker`]) the tracer hands each CPU op
//! output, with its record still lacking the summary, to one thread through a bounded queue, and
//! the forward pass runs on while that thread summarises it ([`crate::digest::summarize_rows`])
//! and pushes the record into the sink. A candle tensor is immutable once produced (the
//! instrumented models build their KV cache by concatenation, never write into a tensor in
//! place), so the worker reads exactly what the op produced; holding the tensor keeps its
//! storage alive until then, for at most [`QUEUE`] ops.
//!
//! Every other item, and the sink's other calls (end of a forward pass, sampling records, the
//! footer), go through the same queue, so the sink sees the same calls in the same order as on
//! the synchronous path: the same trace file, byte for byte. An error (I/O, or candle's while
//! summarising) ends the worker; the tracer returns it at its next call. Dropping the worker
//! lets it finish the queue first, so what was recorded before a run died is still written.

use crate::digest::{summarize_rows, Rows, TokenAxis};
use crate::tracer::Sink;
use candle_core::Tensor;
use candle_trace_format::error::{Error, Result};
use candle_trace_format::record::{Footer, Item, OpRecord};
use candle_trace_format::site::Op;
use std::collections::HashMap;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// Jobs the queue holds at most: a full queue makes the forward pass wait for the worker.
pub const QUEUE: usize = 64;

/// An op record whose digest, statistics, samples and per-token statistics are still to be
/// made from `t` (the op's output, any shape and dtype `summarize_rows` takes).
pub struct Pending {
    /// The record, summary fields empty.
    pub rec: OpRecord,
    /// The op's output.
    pub t: Tensor,
    /// Its token axis, as the tracer worked it out.
    pub axis: Option<TokenAxis>,
    /// The batch rows' windows when the record was made.
    pub rows: Rows,
}

/// A call on the sink, made on the worker.
type Call = Box<dyn FnOnce(&mut dyn Sink) -> Result<()> + Send>;

enum Job {
    Item(Box<Item>),
    Op(Box<Pending>),
    Call(Call),
}

/// The first recorded output holding a NaN or ±Inf that counts: module path and forward pass.
pub type NonFinite = Option<(String, u32)>;

/// The summarising thread and the queue into it. See the module docs.
pub struct Worker {
    tx: Option<SyncSender<Job>>,
    thread: Option<JoinHandle<Result<()>>>,
    nonfinite: Arc<Mutex<NonFinite>>,
}

impl Worker {
    /// Starts the thread, which owns `sink` from now on.
    ///
    /// # Errors
    /// [`Error::Io`] when the thread cannot be started.
    pub fn start(sink: Box<dyn Sink>) -> Result<Worker> {
        let (tx, rx) = sync_channel(QUEUE);
        let nonfinite = Arc::new(Mutex::new(None));
        let seen = nonfinite.clone();
        let thread =
            std::thread::Builder::new().name("candle-trace-summary".into()).spawn(move || work(rx, sink, &seen)).map_err(|source| Error::Io { path: "summary worker thread".into(), source })?;
        Ok(Worker { tx: Some(tx), thread: Some(thread), nonfinite })
    }

    /// Queues `item` for the sink.
    ///
    /// # Errors
    /// The error that ended the worker, if it has ended.
    pub fn push(&mut self, item: Item) -> Result<()> {
        self.send(Job::Item(Box::new(item)))
    }

    /// Queues an op record to summarise and push.
    ///
    /// # Errors
    /// As [`Worker::push`].
    pub fn op(&mut self, p: Pending) -> Result<()> {
        self.send(Job::Op(Box::new(p)))
    }

    /// Queues a call on the sink (end of a forward pass, sampling records, level).
    ///
    /// # Errors
    /// As [`Worker::push`].
    pub fn call(&mut self, f: impl FnOnce(&mut dyn Sink) -> Result<()> + Send + 'static) -> Result<()> {
        self.send(Job::Call(Box::new(f)))
    }

    /// Hands the footer to the sink and waits for the worker to finish the queue.
    ///
    /// # Errors
    /// The first error the worker met (I/O, summarising), or the sink's writing the footer.
    pub fn finish(&mut self, footer: &Footer) -> Result<()> {
        let footer = footer.clone();
        self.call(move |s| s.finish(&footer))?;
        self.join()
    }

    /// The first output holding a NaN or ±Inf among those the worker has pushed (every one,
    /// once [`Worker::finish`] returned).
    pub fn nonfinite(&self) -> NonFinite {
        self.nonfinite.lock().map(|g| g.clone()).unwrap_or(None)
    }

    fn send(&mut self, job: Job) -> Result<()> {
        let sent = match &self.tx {
            Some(tx) => tx.send(job).is_ok(),
            None => false,
        };
        if sent {
            return Ok(());
        }
        // The worker has ended: its error says why.
        self.join()?;
        Err(Error::Candle(candle_core::Error::Msg("the summary worker has stopped".into())))
    }

    /// Closes the queue and waits for the thread: `Ok` once it has emptied the queue.
    fn join(&mut self) -> Result<()> {
        self.tx = None;
        match self.thread.take().map(JoinHandle::join) {
            None | Some(Ok(Ok(()))) => Ok(()),
            Some(Ok(Err(e))) => Err(e),
            Some(Err(_)) => Err(Error::Candle(candle_core::Error::Msg("the summary worker panicked".into()))),
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.join();
    }
}

/// The worker's loop: takes jobs in order until the queue closes or one fails.
fn work(rx: Receiver<Job>, mut sink: Box<dyn Sink>, first: &Mutex<NonFinite>) -> Result<()> {
    // Site id -> (module path, op), from the site items that pass through.
    let mut sites: HashMap<u32, (String, Option<Op>)> = HashMap::new();
    let mut found = false;
    while let Ok(job) = rx.recv() {
        let item = match job {
            Job::Call(f) => {
                f(sink.as_mut())?;
                continue;
            }
            Job::Item(item) => *item,
            Job::Op(p) => Item::Op(summarised(*p)?),
        };
        match &item {
            Item::Site { id, path, op } => {
                sites.insert(*id, (path.clone(), Op::parse(op)));
            }
            Item::Op(rec) if !found => {
                if let Some((path, op)) = sites.get(&rec.site) {
                    if candle_trace_compare::nonfinite::is_nonfinite(*op, rec) {
                        found = true;
                        if let Ok(mut g) = first.lock() {
                            *g = Some((path.clone(), rec.step));
                        }
                    }
                }
            }
            _ => {}
        }
        sink.push(item)?;
    }
    Ok(())
}

/// `p`'s record with its summary filled in.
fn summarised(p: Pending) -> Result<OpRecord> {
    let s = summarize_rows(&p.t, p.axis.as_ref(), &p.rows)?;
    Ok(OpRecord { digest: s.digest, stats: s.stats, samples: s.samples, tokens: s.tokens, ..p.rec })
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
