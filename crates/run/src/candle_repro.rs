//! `trace extract A B -o repro.trace --candle DIR`: the repro as a program that needs candle
//! alone, for a maintainer who does not run this tool. `DIR` gets a Cargo project:
//!
//! - `operands.safetensors`: the op's operands (`x0`, `x1`, …, in the order the op takes them)
//!   and run a's recorded output (`recorded`), written by `candle_core::safetensors::save`; when
//!   run b dumped the op too, b's operands (`b_x0`, `b_x1`, …);
//! - `src/main.rs`: loads them, runs the op with the candle call the instrumented model made
//!   (the same expression as [`crate::kernel::Execute`]), and compares the result with the
//!   recorded output bit for bit (both widened to f32, which is exact), printing either "same
//!   bits as the recording" or where it differs; exit 0 or 1. With b's operands it then runs b's
//!   op on them and compares a's and b's outputs at the first token position whose recorded
//!   digests differ (the element ranges of that position in each output are written into the
//!   program, from [`candle_trace_format::record::token_slice`]): how many elements differ and
//!   by how much, which is the difference the bug report is about;
//! - `Cargo.toml`: `candle-core` and `candle-nn` at the version that made the recording;
//! - `Cargo.lock`: when this build links that candle version, the versions it was built with
//!   (gemm, half, …), cut from its own lockfile ([`crate::repro_lock`]).
//!
//! Ops on a quantized weight (GGUF `QMatMul`) and flash attention have no plain-candle form
//! here: they are refused with a one-line error (`trace replay` runs them).

use crate::kernel::Kernel;
use candle_trace_format::error::{Error, Result};
use candle_trace_format::format::Trace;
use candle_trace_format::record::OperandValue;
use std::collections::HashMap;
use std::path::Path;

/// The candle expression computing `k` from `x0`, `x1`, … (`n` operands), or why there is none.
fn expression(k: &Kernel, n: usize) -> std::result::Result<String, String> {
    Ok(match k {
        Kernel::Input => "x0.clone()".into(),
        Kernel::Embedding => "candle_nn::Embedding::new(x1.clone(), x1.dim(1)?).forward(&x0)?".into(),
        Kernel::RmsNorm { eps } => format!("candle_nn::RmsNorm::new(x1.clone(), {eps:?}).forward(&x0)?"),
        Kernel::LayerNorm { eps } => format!("candle_nn::LayerNorm::new(x1.clone(), x2.clone(), {eps:?}).forward(&x0)?"),
        Kernel::Linear if n > 2 => "candle_nn::Linear::new(x1.clone(), Some(x2.clone())).forward(&x0)?".into(),
        Kernel::Linear => "candle_nn::Linear::new(x1.clone(), None).forward(&x0)?".into(),
        Kernel::Matmul { rhs_t: true } => "x0.matmul(&x1.t()?)?".into(),
        Kernel::Matmul { rhs_t: false } => "x0.matmul(&x1.contiguous()?)?".into(),
        Kernel::Scale { divisor } => format!("(&x0 / {divisor:?})?"),
        Kernel::Affine { mul, add } => format!("x0.affine({mul:?}, {add:?})?"),
        Kernel::WhereCond => "x1.broadcast_as(x0.shape())?.where_cond(&x2.broadcast_as(x0.shape().dims())?, &x0)?".into(),
        Kernel::BroadcastAdd => "x0.broadcast_add(&x1)?".into(),
        Kernel::Softmax { fused: true } => "candle_nn::ops::softmax_last_dim(&x0)?".into(),
        Kernel::Softmax { fused: false } => "candle_nn::ops::softmax(&x0, D::Minus1)?".into(),
        Kernel::SoftmaxWide => "candle_nn::ops::softmax_last_dim(&x0.to_dtype(DType::F32)?)?.to_dtype(x0.dtype())?".into(),
        Kernel::Rope { interleaved: true } => "candle_nn::rotary_emb::rope_i(&x0.contiguous()?, &x1, &x2)?".into(),
        Kernel::Rope { interleaved: false } => "candle_nn::rotary_emb::rope(&x0.contiguous()?, &x1, &x2)?".into(),
        Kernel::Cat { .. } if n == 1 => "x0.clone()".into(),
        Kernel::Cat { dim } => format!("Tensor::cat(&[&x0, &x1], {dim})?"),
        Kernel::Silu => "candle_nn::ops::silu(&x0)?".into(),
        Kernel::Gelu { erf: true } => "x0.gelu_erf()?".into(),
        Kernel::Gelu { erf: false } => "x0.gelu()?".into(),
        Kernel::Mul => "(&x0 * &x1)?".into(),
        Kernel::Add => "(&x0 + &x1)?".into(),
        Kernel::ToDtype { dtype } => format!("x0.to_dtype(DType::{})?", dtype_variant(dtype).ok_or_else(|| format!("dtype {dtype:?}"))?),
        Kernel::MeanPool => "{ let m = x1.to_dtype(DType::F32)?.unsqueeze(2)?; x0.broadcast_mul(&m)?.sum(1)?.broadcast_div(&m.sum(1)?)? }".into(),
        Kernel::Normalize => "x0.broadcast_div(&x0.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?.maximum(1e-12)?)?".into(),
        Kernel::QMatMul => return Err("a matmul on a quantized GGUF weight".into()),
        Kernel::FlashAttn { .. } => return Err("flash attention".into()),
    })
}

/// The `DType` variant of a candle dtype name.
fn dtype_variant(name: &str) -> Option<&'static str> {
    Some(match name {
        "f32" => "F32",
        "f16" => "F16",
        "bf16" => "BF16",
        "f64" => "F64",
        "u32" => "U32",
        "u8" => "U8",
        "i64" => "I64",
        _ => return None,
    })
}

/// Whether `dir` may receive the project: it does not exist, is an empty folder (but for
/// `own`, the repro trace itself, which may be written there), or holds a project this module
/// wrote before (its `Cargo.toml` names the package `candle-repro`), which is written over.
/// Anything else (a file, a folder of other files, someone's own Cargo project) is refused, so
/// nothing of the user's is overwritten.
///
/// # Errors
/// [`Error::Usage`] naming `dir` and why; I/O errors listing it.
pub fn check_dir(dir: &Path, own: Option<&Path>) -> Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    let refuse = |why: &str| Err(Error::usage(format!("--candle {}: {why}; name a new or empty folder", dir.display())));
    if !dir.is_dir() {
        return refuse("is a file, not a folder for the Cargo project");
    }
    let own = own.and_then(|o| o.canonicalize().ok());
    let mut entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?.filter_map(|e| e.ok()).filter(|e| e.path().canonicalize().ok() != own);
    if entries.next().is_none() {
        return Ok(());
    }
    let ours = std::fs::read_to_string(dir.join("Cargo.toml")).is_ok_and(|t| t.lines().any(|l| l.trim() == "name = \"candle-repro\""));
    if ours {
        return Ok(());
    }
    refuse("holds files that are not a candle-repro project written by `trace extract --candle`, which it would overwrite")
}

/// Writes the candle-only project of repro trace `t` into `dir` (see the module docs), which
/// [`check_dir`] must accept.
///
/// # Errors
/// As [`check_dir`] and [`candle_trace_compare::repro::plan`]; [`Error::Usage`] for an op
/// without a plain-candle form, a quantized operand, or a repro without a's recorded output;
/// I/O errors naming the file.
pub fn write(t: &Trace, dir: &Path) -> Result<()> {
    check_dir(dir, Some(&t.path))?;
    let plan = candle_trace_compare::repro::plan(t, None)?;
    let refuse = |why: String| Error::usage(format!("--candle: {} ({}) is {why}: `trace replay` runs it, a candle-only program cannot", plan.path, plan.op));
    let expr = expression(plan.kernel, plan.operands.len()).map_err(refuse)?;
    let device = candle_core::Device::Cpu;
    let mut tensors: HashMap<String, candle_core::Tensor> = HashMap::new();
    for (i, v) in plan.operands.iter().enumerate() {
        let OperandValue::Tensor(d) = v else { return Err(refuse("an op on a quantized weight".into())) };
        tensors.insert(format!("x{i}"), crate::values::to_tensor(d, &device)?);
    }
    let recorded = plan.recorded.ok_or_else(|| Error::usage(format!("--candle: the repro holds no recorded output of {}", plan.path)))?;
    tensors.insert("recorded".into(), crate::values::to_tensor(recorded, &device)?);
    let b = b_side(&plan, &mut tensors, &device)?;
    std::fs::create_dir_all(dir.join("src")).map_err(|e| Error::io(dir, e))?;
    let st = dir.join("operands.safetensors");
    candle_core::safetensors::save(&tensors, &st).map_err(|e| Error::io(&st, std::io::Error::other(e.to_string())))?;
    let candle = t.header.env.candle_version.as_str();
    let candle = if candle.chars().all(|c| c.is_ascii_digit() || c == '.') && !candle.is_empty() { candle } else { "0.11.1" };
    let files = [
        ("Cargo.toml", format!("[package]\nname = \"candle-repro\"\nversion = \"0.1.0\"\nedition = \"2021\"\npublish = false\n\n[dependencies]\ncandle-core = \"={candle}\"\ncandle-nn = \"={candle}\"\n\n[workspace]\n")),
        ("src/main.rs", program(plan.path, plan.op, &expr, plan.operands.len(), b.as_ref())),
    ];
    let lock = crate::repro_lock::lockfile(candle).map(|l| ("Cargo.lock", l));
    for (name, text) in files.into_iter().chain(lock) {
        let f = dir.join(name);
        std::fs::write(&f, text).map_err(|e| Error::io(&f, e))?;
    }
    // Readable by others as the other files are (the safetensors writer makes its file 0600).
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&st, std::fs::Permissions::from_mode(0o644)).map_err(|e| Error::io(&st, e))?;
    }
    Ok(())
}

/// Run b's side of the program: its op's expression and operand count, and the token position
/// compared with the element ranges it covers in a's output and in b's (flattened).
struct BSide {
    expr: String,
    n: usize,
    position: u32,
    a_at: Vec<std::ops::Range<usize>>,
    b_at: Vec<std::ops::Range<usize>>,
}

/// Puts b's operands into `tensors` (`b_x0`, …) and returns what the program compares, when the
/// repro holds them as dense tensors and both records have a token axis with a position whose
/// recorded digests differ; `None` otherwise (the program then runs a's op only).
///
/// # Errors
/// An operand that does not convert to a tensor.
fn b_side(plan: &candle_trace_compare::repro::Plan<'_>, tensors: &mut HashMap<String, candle_core::Tensor>, device: &candle_core::Device) -> Result<Option<BSide>> {
    let Some((c, cvals)) = plan.counterpart.as_ref().filter(|(_, v)| !v.is_empty()) else { return Ok(None) };
    let (ra, rb) = (plan.record, &c.record);
    let dims = |r: &candle_trace_format::record::OpRecord| r.shape.iter().map(|&d| d as usize).collect::<Vec<usize>>();
    // The ranges index the outputs the program computes, which have the recorded shapes.
    let Some(at) = candle_trace_compare::repro::first_differing(ra, &dims(ra), rb, &dims(rb)) else { return Ok(None) };
    let Ok(expr) = expression(rb.kernel.as_ref().unwrap_or(plan.kernel), cvals.len()) else { return Ok(None) };
    let mut bt = Vec::new();
    for (i, v) in cvals.iter().enumerate() {
        let OperandValue::Tensor(d) = v else { return Ok(None) };
        bt.push((format!("b_x{i}"), crate::values::to_tensor(d, device)?));
    }
    tensors.extend(bt);
    Ok(Some(BSide { expr, n: cvals.len(), position: at.position, a_at: at.a_at, b_at: at.b_at }))
}

/// The program's source: load, run `expr`, compare bits with the recording; with `b`, run b's
/// op on b's operands and compare a's and b's outputs at `b.position`.
fn program(path: &str, op: &str, expr: &str, n: usize, b: Option<&BSide>) -> String {
    let loads: String = (0..n).map(|i| format!("    let x{i} = get(\"x{i}\")?;\n")).collect();
    let what = candle_trace_compare::text::clean(&format!("{path} ({op})")).replace('\\', "\\\\").replace('"', "\\\"");
    // Inside the generated `println!` format string, braces are doubled.
    let what_fmt = what.replace('{', "{{").replace('}', "}}");
    let b_run = b_closure(b);
    format!(
        r#"//! Re-runs {what} from a candle-trace repro with candle alone: the op on the recorded
//! operands, compared bit for bit with the output the recording run got (and, when the repro
//! holds them, the other run's op on its own operands, compared with this one's output).
#![allow(unused_imports)]
use candle_core::{{DType, Device, Tensor, D}};
use candle_nn::Module;

/// The bits of `t` widened to f32 (exact, so equal f32 bits are equal bits of its own dtype).
fn bits(t: &Tensor) -> candle_core::Result<Vec<u32>> {{
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f32::to_bits).collect())
}}

fn main() -> candle_core::Result<()> {{
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut t = candle_core::safetensors::load(dir.join("operands.safetensors"), &Device::Cpu)?;
    let mut get = |k: &str| t.remove(k).ok_or_else(|| candle_core::Error::Msg(format!("{{k}} missing")));
{loads}    let recorded = get("recorded")?;
    let y: Tensor = {expr};
    let b_diff = {b_run};
    let (got, want) = (bits(&y)?, bits(&recorded)?);
    println!("{what_fmt}: output {{:?}} {{:?}}", y.dims(), y.dtype());
    if y.dims() == recorded.dims() && y.dtype() == recorded.dtype() && got == want {{
        println!("same bits as the recording ({{}} elements)", got.len());
        b_diff(&y)?;
        return Ok(());
    }}
    let differ: Vec<usize> = (0..got.len().min(want.len())).filter(|&i| got[i] != want[i]).collect();
    println!("DIFFERS from the recording: {{}} of {{}} elements (recorded {{:?}} {{:?}})", differ.len(), got.len(), recorded.dims(), recorded.dtype());
    if let Some(&i) = differ.first() {{
        println!("first at element {{i}}: got {{}} (0x{{:08x}}), recorded {{}} (0x{{:08x}})", f32::from_bits(got[i]), got[i], f32::from_bits(want[i]), want[i]);
    }}
    b_diff(&y)?;
    std::process::exit(1);
}}
"#
    )
}

/// The generated closure that runs b's op and prints how a's and b's outputs differ at the
/// position compared (a no-op without `b`). Its operands are loaded from `get` first.
fn b_closure(b: Option<&BSide>) -> String {
    let Some(b) = b else { return "|_: &Tensor| -> candle_core::Result<()> { Ok(()) }".into() };
    let ranges = |r: &[std::ops::Range<usize>]| r.iter().map(|x| format!("({}, {})", x.start, x.end)).collect::<Vec<_>>().join(", ");
    let loads: String = (0..b.n).map(|i| format!("let x{i} = get(\"b_x{i}\")?; ")).collect();
    format!(
        r#"{{
        // Run b's op on b's operands (what the other run fed it), then a's and b's outputs at
        // token position {pos}, the first whose recorded digests differ.
        let yb: Tensor = {{ {loads}{expr} }};
        move |y: &Tensor| -> candle_core::Result<()> {{
            let pick = |v: &[u32], at: &[(usize, usize)]| -> Vec<f32> {{ at.iter().flat_map(|&(s, e)| v[s..e].iter().map(|&x| f32::from_bits(x))).collect() }};
            let (a, b) = (pick(&bits(y)?, &[{a_at}]), pick(&bits(&yb)?, &[{b_at}]));
            let differ = a.iter().zip(&b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
            let largest = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
            println!("run b's op on b's operands: output {{:?}}; at token position {pos}, a's and b's outputs differ in {{differ}} of {{}} elements, largest |a - b| {{largest:e}}", yb.dims(), a.len());
            Ok(())
        }}
    }}"#,
        pos = b.position,
        expr = b.expr,
        a_at = ranges(&b.a_at),
        b_at = ranges(&b.b_at),
    )
}

#[cfg(test)]
mod tests {
    use super::{expression, program};
    use crate::kernel::Kernel;

    #[test]
    fn every_dense_kernel_has_an_expression_and_quantized_ones_are_refused() {
        assert_eq!(expression(&Kernel::Matmul { rhs_t: true }, 2).unwrap(), "x0.matmul(&x1.t()?)?");
        assert!(expression(&Kernel::QMatMul, 2).is_err() && expression(&Kernel::FlashAttn { scale: 1.0 }, 3).is_err());
        assert!(expression(&Kernel::ToDtype { dtype: "f7".into() }, 1).is_err());
        let src = program("layers.0.\"x\"\u{1b}", "matmul", "x0.matmul(&x1.t()?)?", 2, None);
        assert!(src.contains("let x1 = get(\"x1\")?;") && src.contains("let y: Tensor = x0.matmul(&x1.t()?)?;"), "{src}");
        assert!(!src.contains('\u{1b}') && src.contains("layers.0.\\\"x\\\"\\\\u{1b}"), "a crafted path stays inside its string literal:\n{src}");
    }
}
