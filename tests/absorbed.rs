//! Which root bisect reports: a difference that dies out inside its layer (the layer's output
//! matches) is listed as absorbed, and the first root that reaches its layer's output is the one
//! named. The layer's output is the last op the layer records, whatever the model calls it, so
//! this holds for BERT's `encoder.layer.N.output.LayerNorm` and for models traced with
//! `Tracer::probe` as it does for the decoders' `layers.N.mlp_residual`.

use candle_core::{Device, Tensor};
use candle_trace::format::{encode_trace, Trace};
use candle_trace::record::{Header, Phase, Reads};
use candle_trace::tracer::{MemorySink, Tok, Tracer};

/// A two-layer encoder named as BERT is, traced with `probe`: run b differs in layer 0's
/// attention by one ULP, which layer 0's output rounds away, and in layer 1's attention, which
/// reaches layer 1's output.
fn run(b: bool, prefix: &str, out: &str) -> Trace {
    let dev = Device::Cpu;
    let sink = MemorySink::default();
    let mut tr = Tracer::new(Box::new(sink.clone()));
    let ids = Tensor::new(&[[1u32, 2]], &dev).unwrap();
    let t = |v: &[f32]| Tensor::new(v, &dev).unwrap().reshape((1, 2, v.len() / 2)).unwrap();
    tr.begin_forward(Phase::Prefill, 0, &ids).unwrap();
    let x = tr.probe("embeddings.LayerNorm", t(&[0.5, 1.5, 2.5, 3.5]), &[], Tok::Seq(1)).unwrap();
    let wiggle = f32::from_bits(2.0f32.to_bits() + u32::from(b));
    let a0 = tr.probe(&format!("{prefix}.0.attention.self.softmax"), t(&[1.0, wiggle, 1.0, 2.0]), &[(&x, Reads::Same)], Tok::Seq(1)).unwrap();
    let o0 = tr.probe(&format!("{prefix}.0.{out}"), t(&[0.25, 0.75, 0.25, 0.75]), &[(&a0, Reads::Same)], Tok::Seq(1)).unwrap();
    let a1 = tr.probe(&format!("{prefix}.1.attention.self.softmax"), t(&[3.0, if b { 4.5 } else { 4.0 }, 3.0, 4.0]), &[(&o0, Reads::Same)], Tok::Seq(1)).unwrap();
    tr.probe(&format!("{prefix}.1.{out}"), t(&[5.0, if b { 6.5 } else { 6.0 }, 5.0, 6.0]), &[(&a1, Reads::Same)], Tok::Seq(1)).unwrap();
    tr.end_forward().unwrap();
    sink.trace(if b { "b.trace" } else { "a.trace" }, &Header::default())
}

#[test]
fn the_reported_root_is_the_first_to_reach_its_layer_output_whatever_it_is_called() {
    let d = crate::util::tmp();
    for (prefix, out) in [("encoder.layer", "output.LayerNorm"), ("layers", "mlp_residual"), ("layers", "block_out")] {
        let (a, b) = (run(false, prefix, out), run(true, prefix, out));
        let in_memory = candle_trace::bisect::bisect(&a, &b).unwrap();
        // The streaming bisect `trace bisect` runs decides the same.
        let (pa, pb) = (d.path().join("a.trace"), d.path().join("b.trace"));
        std::fs::write(&pa, encode_trace(&a.header, &a.items, a.footer.as_ref()).unwrap()).unwrap();
        std::fs::write(&pb, encode_trace(&b.header, &b.items, b.footer.as_ref()).unwrap()).unwrap();
        let (streamed, _, _) = candle_trace::bisect_file::bisect_files(&pa, &pb).unwrap();
        for r in [&in_memory, &streamed] {
            let root = r.first_divergence.as_ref().expect("a root");
            assert_eq!(root.path, format!("{prefix}.1.attention.self.softmax"), "{prefix}.N.{out}");
            assert_eq!(r.absorbed_count, 1, "{prefix}.N.{out}");
            assert_eq!(r.absorbed[0].path, format!("{prefix}.0.attention.self.softmax"));
        }
    }
}
