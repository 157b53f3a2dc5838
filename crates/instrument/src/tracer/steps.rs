//! The decode step's records: the run settings (format 2.7), the repeat penalty's and the
//! sampler's records, and the step's choice.

use super::Tracer;
use candle_trace_format::error::Result;
use candle_trace_format::record::{Item, TokenEvent};

impl Tracer {
    /// Records the run settings added in format 2.7 (the repeat penalty): call once, before
    /// the first forward pass; nothing is written when `settings` is empty.
    ///
    /// # Errors
    /// The sink's (I/O).
    pub fn settings(&mut self, settings: &candle_trace_format::record::Settings) -> Result<()> {
        match &mut self.sink {
            Some(s) if !settings.0.is_empty() => {
                let settings = settings.clone();
                s.call(move |s| s.settings(&settings), false)
            }
            _ => Ok(()),
        }
    }

    /// Records how the repeat penalty changed a decode step's logits, per row (before
    /// [`Tracer::sampling`]); nothing for an empty list.
    ///
    /// # Errors
    /// The sink's (I/O).
    pub fn penalty(&mut self, steps: &[candle_trace_format::record::PenaltyStep]) -> Result<()> {
        match &mut self.sink {
            Some(s) if !steps.is_empty() => {
                let steps = steps.to_vec();
                s.call(move |s| s.penalty(&steps), false)
            }
            _ => Ok(()),
        }
    }

    /// Records how a decode step chose each row's token (before [`Tracer::token`]).
    pub fn sampling(&mut self, steps: &[candle_trace_format::record::SamplingStep]) -> Result<()> {
        match &mut self.sink {
            Some(s) => {
                let steps = steps.to_vec();
                s.call(move |s| s.sampling(&steps), false)
            }
            None => Ok(()),
        }
    }

    /// Records a decode step's choice.
    pub fn token(&mut self, ev: TokenEvent) -> Result<()> {
        self.push(Item::Token(ev))
    }
}
