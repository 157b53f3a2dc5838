//! Where a tracer's items go: the [`Sink`] trait, a trace file ([`TraceWriter`]) and memory
//! ([`MemorySink`]).

use candle_trace_format::error::Result;
use candle_trace_format::format::TraceWriter;
use candle_trace_format::record::{Footer, Item, OpRecord};
use candle_trace_format::site::Level;
use std::sync::{Arc, Mutex};

/// Where recorded items go. `Send`, so that a summary worker can own it.
pub trait Sink: Send {
    /// Accepts one item.
    fn push(&mut self, item: Item) -> Result<()>;
    /// Accepts one decode step's sampling records (a file sink writes them as an optional frame).
    fn sampling(&mut self, _steps: &[candle_trace_format::record::SamplingStep]) -> Result<()> {
        Ok(())
    }
    /// Accepts the run settings added in format 2.7, once, before any item (a file sink writes
    /// them as an optional frame when any is set).
    fn settings(&mut self, _settings: &candle_trace_format::record::Settings) -> Result<()> {
        Ok(())
    }
    /// Accepts one decode step's repeat-penalty records, before its sampling records.
    fn penalty(&mut self, _steps: &[candle_trace_format::record::PenaltyStep]) -> Result<()> {
        Ok(())
    }
    /// Called at the end of every forward pass (a file sink writes its frame here).
    fn end_forward(&mut self) -> Result<()> {
        Ok(())
    }
    /// Called once when the run is over.
    fn finish(&mut self, _footer: &Footer) -> Result<()> {
        Ok(())
    }
    /// Called once, before any item, when the run records at a [`Level`] other than `Ops`.
    fn level(&mut self, _level: Level) -> Result<()> {
        Ok(())
    }
    /// Accepts one op record, filled by `fill` (which sets every field) into a record the
    /// sink provides: the default pushes a new one; a file sink fills one of a frame already
    /// written in place, its lists' memory reused ([`TraceWriter::push_op`]). When `fill`
    /// fails, nothing is pushed.
    ///
    /// # Errors
    /// `fill`'s error, or as [`Sink::push`].
    fn push_op(&mut self, fill: &mut dyn FnMut(&mut OpRecord) -> Result<()>) -> Result<()> {
        let mut rec = OpRecord::default();
        fill(&mut rec)?;
        self.push(Item::Op(rec))
    }
}

impl Sink for TraceWriter {
    fn push_op(&mut self, fill: &mut dyn FnMut(&mut OpRecord) -> Result<()>) -> Result<()> {
        TraceWriter::push_op(self, fill)
    }
    fn push(&mut self, item: Item) -> Result<()> {
        TraceWriter::push(self, item)
    }
    fn end_forward(&mut self) -> Result<()> {
        self.flush()
    }
    fn sampling(&mut self, steps: &[candle_trace_format::record::SamplingStep]) -> Result<()> {
        TraceWriter::sampling(self, steps)
    }
    fn settings(&mut self, settings: &candle_trace_format::record::Settings) -> Result<()> {
        TraceWriter::settings(self, settings)
    }
    fn penalty(&mut self, steps: &[candle_trace_format::record::PenaltyStep]) -> Result<()> {
        TraceWriter::penalty(self, steps)
    }
    fn finish(&mut self, footer: &Footer) -> Result<()> {
        self.finish_in_place(footer)
    }
    fn level(&mut self, level: Level) -> Result<()> {
        TraceWriter::level(self, level)
    }
}

/// Keeps items in memory, shared with the caller (tests, in-process bisect).
#[derive(Clone, Default)]
pub struct MemorySink {
    /// Items pushed so far, in order.
    pub items: Arc<Mutex<Vec<Item>>>,
    /// The footer, once the run finished.
    pub footer: Arc<Mutex<Option<Footer>>>,
    /// Sampling records, in order.
    pub sampling: Arc<Mutex<Vec<candle_trace_format::record::SamplingStep>>>,
    /// The level the run records at.
    pub level: Arc<Mutex<Level>>,
    /// The run settings and repeat-penalty records (format 2.7).
    pub extras: Arc<Mutex<candle_trace_format::record::Extras>>,
}

impl MemorySink {
    /// What was recorded, as a [`candle_trace_format::format::Trace`] named `name` with `header` (truncated
    /// when the run did not finish), for bisecting in process. The recorded items move into the
    /// trace: the sink is left empty.
    pub fn trace(&self, name: &str, header: &candle_trace_format::record::Header) -> candle_trace_format::format::Trace {
        let footer = self.footer.lock().expect("memory sink poisoned").take();
        candle_trace_format::format::Trace {
            path: name.into(),
            header: header.clone(),
            items: std::mem::take(&mut *self.items.lock().expect("memory sink poisoned")),
            truncated: footer.is_none(),
            footer,
            sampling: std::mem::take(&mut *self.sampling.lock().expect("memory sink poisoned")),
            build: Some(crate::env::build_info()),
            level: *self.level.lock().expect("memory sink poisoned"),
            extras: std::mem::take(&mut *self.extras.lock().expect("memory sink poisoned")),
        }
    }
}

impl Sink for MemorySink {
    fn push(&mut self, item: Item) -> Result<()> {
        self.items.lock().expect("memory sink poisoned").push(item);
        Ok(())
    }
    fn sampling(&mut self, steps: &[candle_trace_format::record::SamplingStep]) -> Result<()> {
        self.sampling.lock().expect("memory sink poisoned").extend_from_slice(steps);
        Ok(())
    }
    fn settings(&mut self, settings: &candle_trace_format::record::Settings) -> Result<()> {
        self.extras.lock().expect("memory sink poisoned").settings = settings.clone();
        Ok(())
    }
    fn penalty(&mut self, steps: &[candle_trace_format::record::PenaltyStep]) -> Result<()> {
        self.extras.lock().expect("memory sink poisoned").penalty.extend_from_slice(steps);
        Ok(())
    }
    fn finish(&mut self, footer: &Footer) -> Result<()> {
        *self.footer.lock().expect("memory sink poisoned") = Some(footer.clone());
        Ok(())
    }
    fn level(&mut self, level: Level) -> Result<()> {
        *self.level.lock().expect("memory sink poisoned") = level;
        Ok(())
    }
}
