//! `cargo run --release --example gguf_to_hf -- MODEL.gguf OUT_DIR`: writes a Hugging Face llama
//! folder (f32 safetensors, config.json, tokenizer.json) from a llama GGUF file. See
//! `candle_trace::models::export`. Used by `tools/gguf-to-hf.sh`.

use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [gguf, out] = args.as_slice() else {
        eprintln!("usage: gguf_to_hf MODEL.gguf OUT_DIR");
        return ExitCode::from(2);
    };
    match candle_trace::models::export::gguf_to_hf(&PathBuf::from(gguf), &PathBuf::from(out)) {
        Ok(()) => {
            println!("wrote {out}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gguf_to_hf: error: {e}");
            ExitCode::from(2)
        }
    }
}
