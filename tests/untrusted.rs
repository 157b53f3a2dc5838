//! A trace is untrusted input and a public attachment: crafted files are refused with one line
//! and exit 2 (one test per refusal, each on a byte-literal or hand-built input), a few-KB file
//! cannot make `show` or `bisect` use 256 MB, and a recording holds no user name, host name or
//! home path.

use crate::util::{p, tmp, trace_s};
use candle_trace::error::Error;
use candle_trace::format::{decode_trace, encode_trace, frame_bytes, items_frame_bytes, preamble, Refusal, KIND_FOOTER, KIND_HEADER, KIND_ITEMS};
use candle_trace::record::{Dump, Footer, Forward, Header, Item, Kernel, OpRecord, OperandValue, Phase, Stats, TokenEvent, TokenStat};
use std::path::Path;

fn op(seq: u64, site: u32, shape: Vec<u32>) -> OpRecord {
    OpRecord {
        seq,
        step: 0,
        site,
        inputs: Vec::new(),
        dtype: "f32".into(),
        shape,
        digest: 0,
        stats: Stats::default(),
        samples: Vec::new(),
        tokens: Vec::new(),
        axis: None,
        kernel: None,
        operands: Vec::new(),
        perturbed: false,
    }
}

fn site(id: u32, path: &str, op: &str) -> Item {
    Item::Site { id, path: path.into(), op: op.into() }
}

fn bytes(items: &[Item]) -> Vec<u8> {
    encode_trace(&Header::default(), items, Some(&Footer { items: items.len() as u64, op_records: count_ops(items), ..Footer::default() })).unwrap()
}

fn count_ops(items: &[Item]) -> u64 {
    items.iter().filter(|i| matches!(i, Item::Op(_))).count() as u64
}

/// The refusal of `bytes`, which must be refused.
fn refusal(bytes: &[u8]) -> Refusal {
    match decode_trace(bytes, Path::new("crafted.trace")) {
        Err(Error::Refused { path, why }) => {
            assert_eq!(path, Path::new("crafted.trace"));
            why
        }
        Err(e) => panic!("refused with another error: {e}"),
        Ok(_) => panic!("accepted"),
    }
}

fn frame_header(kind: u8, clen: u32, ulen: u32, sum: u64) -> Vec<u8> {
    let mut v = vec![kind];
    v.extend(clen.to_le_bytes());
    v.extend(ulen.to_le_bytes());
    v.extend(sum.to_le_bytes());
    v
}

#[test]
fn preamble_refusals() {
    assert_eq!(refusal(b""), Refusal::Empty);
    assert_eq!(refusal(b"\x89CTRACX\n\x01\x00\x00\x00"), Refusal::BadMagic);
    assert_eq!(refusal(b"\x89CTRACE\n\x01\x00"), Refusal::NoHeader);
    assert_eq!(refusal(b"\x89CTRACE\n\x03\x00\x00\x00"), Refusal::NewerVersion { found: 3, reads: 2 });
    assert_eq!(refusal(b"\x89CTRACE\n\x02\x00\x00\x00"), Refusal::NoHeader);
    assert_eq!(refusal(b"\x89CTRACE\n\x00\x00\x00\x00"), Refusal::OlderVersion { found: 0, reads: 1 });
    assert_eq!(refusal(b"\x89CTRACE\n\x01\x00\x04\x00"), Refusal::UnknownFlags(4));
    assert_eq!(refusal(b"\x89CTRACE\n\x01\x00\x00\x00"), Refusal::NoHeader);
    // Format 2: byte 10 is the minor version, byte 11 the flags. Format 1's u16 of flags is
    // read as it always was (above: `04 00` is flag bit 2, not minor 4).
    assert_eq!(refusal(b"\x89CTRACE\n\x02\x00\x07\x01"), Refusal::UnknownFlags(1));
    assert_eq!(refusal(b"\x89CTRACE\n\x02\x00\x07\x00"), Refusal::NoHeader);
}

/// `bytes` (a whole trace) with its first items frame's payload passed through `edit` and the
/// preamble's minor version set to `minor`.
fn with_items_edited(bytes: &[u8], minor: u8, edit: impl Fn(&mut Vec<u8>)) -> Vec<u8> {
    let mut out = bytes[..12].to_vec();
    out[10] = minor;
    let mut at = 12;
    while at < bytes.len() {
        let clen = u32::from_le_bytes(bytes[at + 1..at + 5].try_into().unwrap()) as usize;
        let end = at + 17 + clen;
        if bytes[at] == KIND_ITEMS {
            let mut raw = zstd::bulk::decompress(&bytes[at + 17..end], 1 << 20).unwrap();
            edit(&mut raw);
            out.extend(raw_frame(KIND_ITEMS, &raw));
        } else {
            out.extend(&bytes[at..end]);
        }
        at = end;
    }
    out
}

/// The format's own rule (docs/trace-format.md, Evolution): a kernel added in a later minor
/// version is refused as "written by a newer version", naming both versions, not as an unknown
/// enum variant; in a file of this build's minor version the same bytes are corruption.
#[test]
fn a_kernel_of_a_newer_minor_version_is_named_as_such() {
    assert_eq!(preamble()[8..12], [2, 0, candle_trace::format::MINOR, 0]);
    let mut r = op(0, 0, vec![2]);
    r.kernel = Some(Kernel::Affine { mul: 1.25, add: -0.5 });
    let b = bytes(&[site(0, "x", "affine"), Item::Op(r)]);
    assert!(decode_trace(&b, Path::new("crafted.trace")).is_ok());
    // Kernel index 20 (Affine) then mul, f64 LE: turned into index 23, a kernel this build lacks.
    let kernel_23 = |raw: &mut Vec<u8>| {
        let mut needle = vec![20u8];
        needle.extend(1.25f64.to_le_bytes());
        let i = raw.windows(9).position(|w| w == needle.as_slice()).expect("the Affine kernel in the payload");
        raw[i] = 23;
    };
    let newer = with_items_edited(&b, candle_trace::format::MINOR + 1, kernel_23);
    let why = refusal(&newer);
    assert!(matches!(&why, Refusal::NewerMinor { found: (2, m), reads: (2, r), .. } if *m == candle_trace::format::MINOR + 1 && *r == candle_trace::format::MINOR), "{why:?}");
    let msg = why.to_string();
    assert!(msg.contains(&format!("written by a newer version (trace format 2.{}; this build reads up to 2.{})", candle_trace::format::MINOR + 1, candle_trace::format::MINOR)), "{msg}");
    assert!(matches!(refusal(&with_items_edited(&b, candle_trace::format::MINOR, kernel_23)), Refusal::Decode { .. }));
    // Format-2 files written before the minor version was stored (byte 10 = 0) read as they did.
    assert!(decode_trace(&with_items_edited(&b, 0, |_| {}), Path::new("old.trace")).is_ok());
}

#[test]
fn frame_header_refusals() {
    let mut b = preamble().to_vec();
    b.extend(frame_header(0, 1, 1, 0));
    b.push(0);
    assert_eq!(refusal(&b), Refusal::UnknownFrameKind { at: 12, kind: 0 });
    let mut b = preamble().to_vec();
    b.extend(frame_header(7, 1, 1, 0));
    b.push(0);
    assert_eq!(refusal(&b), Refusal::UnknownFrameKind { at: 12, kind: 7 });
    let mut b = preamble().to_vec();
    b.extend(frame_header(KIND_HEADER, 8, u32::MAX, 0));
    b.extend([0; 8]);
    assert_eq!(refusal(&b), Refusal::FrameTooLarge { at: 12, compressed: 8, decompressed: u32::MAX });
    // A frame that says it decompresses to 60 MiB, in a 40-byte file: over the budget, refused
    // before anything is allocated for it.
    let mut b = preamble().to_vec();
    b.extend(frame_header(KIND_HEADER, 8, 60 << 20, 0));
    b.extend([0; 8]);
    assert_eq!(refusal(&b), Refusal::DecompressedBudget { at: 12, budget: 32 << 20 });
    // Garbage payload.
    let mut b = preamble().to_vec();
    b.extend(frame_header(KIND_HEADER, 4, 4, 0));
    b.extend(b"junk");
    assert!(matches!(refusal(&b), Refusal::Decompress { at: 12, .. }));
}

#[test]
fn payload_refusals() {
    let good = frame_bytes(KIND_HEADER, &Header::default()).unwrap();
    // Checksum.
    let mut f = good.clone();
    f[9] ^= 1;
    let mut b = preamble().to_vec();
    b.extend(f);
    assert_eq!(refusal(&b), Refusal::Checksum { at: 12 });
    // Length: a payload that decompresses to fewer bytes than the header says.
    let mut f = good.clone();
    let ulen = u32::from_le_bytes(f[5..9].try_into().unwrap());
    f[5..9].copy_from_slice(&(ulen + 1).to_le_bytes());
    let mut b = preamble().to_vec();
    b.extend(f);
    assert!(matches!(refusal(&b), Refusal::LengthMismatch { at: 12, .. } | Refusal::Decompress { at: 12, .. }));
    // Left-over bytes: a header followed by one more byte in the same payload.
    let mut raw = postcard::to_stdvec(&Header::default()).unwrap();
    raw.push(0);
    let mut b = preamble().to_vec();
    b.extend(raw_frame(KIND_HEADER, &raw));
    assert_eq!(refusal(&b), Refusal::LeftOver { at: 12, bytes: 1 });
    // Not a header at all.
    let mut b = preamble().to_vec();
    b.extend(raw_frame(KIND_HEADER, &[0xff; 3]));
    assert!(matches!(refusal(&b), Refusal::Decode { at: 12, .. }));
}

/// A frame whose payload is `raw` as given (not postcard-encoded here).
fn raw_frame(kind: u8, raw: &[u8]) -> Vec<u8> {
    let packed = zstd::bulk::compress(raw, 3).unwrap();
    let mut v = frame_header(kind, packed.len() as u32, raw.len() as u32, candle_trace::hash::xxh3_64(raw));
    v.extend(packed);
    v
}

/// The whole frame `frame` with its payload compressed again at zstd's strongest level, as a
/// crafted file would be (the writer's own level leaves more bytes on disk).
fn squeezed(frame: &[u8]) -> Vec<u8> {
    let ulen = u32::from_le_bytes(frame[5..9].try_into().unwrap());
    let raw = zstd::bulk::decompress(&frame[17..], ulen as usize).unwrap();
    let packed = zstd::bulk::compress(&raw, 19).unwrap();
    let mut v = frame_header(frame[0], packed.len() as u32, ulen, candle_trace::hash::xxh3_64(&raw));
    v.extend(packed);
    v
}

#[test]
fn memory_budget_and_optional_frames() {
    // Site items cost a few bytes each on disk and a whole `Item` each in memory: the budget
    // stops the expansion.
    let mut b = preamble().to_vec();
    b.extend(frame_bytes(KIND_HEADER, &Header::default()).unwrap());
    let per_frame = 4096u32;
    let frames = (33u64 << 20) / (per_frame as u64 * std::mem::size_of::<Item>() as u64) + 1;
    for f in 0..frames as u32 {
        let sites: Vec<Item> = (0..per_frame).map(|i| site(f * per_frame + i, "", "")).collect();
        b.extend(squeezed(&items_frame_bytes(&sites).unwrap()));
    }
    assert!(b.len() < 128 << 10, "{} bytes: the budget is then over its 32 MiB floor", b.len());
    assert!(matches!(refusal(&b), Refusal::MemoryBudget { budget, .. } if budget == 32 << 20));
    // 4096 empty value parts a frame cost 2 bytes each on disk: the reader joins parts as they
    // come, so they hold nothing; without a value after them (the file is cut), they are dropped.
    let (_, b) = bombs().into_iter().find(|(n, _)| *n == "value-parts").unwrap();
    let t = decode_trace(&b, Path::new("parts.trace")).unwrap();
    assert_eq!((t.items.len(), t.truncated), (0, true));
    // An optional frame kind (128..=255), as a later minor version may add: skipped.
    let mut b = preamble().to_vec();
    b.extend(frame_bytes(KIND_HEADER, &Header::default()).unwrap());
    b.extend(raw_frame(200, b"anything a later minor version writes"));
    b.extend(items_frame_bytes(&[site(0, "x", "add")]).unwrap());
    b.extend(frame_bytes(KIND_FOOTER, &Footer { items: 1, ..Footer::default() }).unwrap());
    let t = decode_trace(&b, Path::new("minor.trace")).unwrap();
    assert_eq!((t.items.len(), t.truncated), (1, false));
}

#[test]
fn item_count_is_capped_before_decoding() {
    // 4097 items declared (varint 0x81 0x20), none present.
    let mut b = preamble().to_vec();
    b.extend(frame_bytes(KIND_HEADER, &Header::default()).unwrap());
    b.extend(raw_frame(KIND_ITEMS, &[0x81, 0x20]));
    assert_eq!(refusal(&b), Refusal::TooManyItems { at: b.len() - raw_frame(KIND_ITEMS, &[0x81, 0x20]).len(), count: 4097 });
    // A list over its field's cap: a shape of rank 9.
    let b = bytes(&[site(0, "x", "add"), Item::Op(op(0, 0, vec![1; 9]))]);
    match refusal(&b) {
        Refusal::Decode { msg, .. } => assert_eq!(msg, "a list of 9 elements, over the cap of 8"),
        r => panic!("{r:?}"),
    }
}

#[test]
fn structural_refusals() {
    let invalid = |items: &[Item], needle: &str| match refusal(&bytes(items)) {
        Refusal::Invalid { msg, .. } => assert!(msg.contains(needle), "{msg}"),
        r => panic!("{r:?}"),
    };
    // A record naming a site never declared: refused, not "every op output is finite".
    invalid(&[site(0, "x", "add"), Item::Op(op(0, 3, vec![2]))], "names site 3, but 1 sites are declared");
    invalid(&[site(1, "x", "add")], "site 1 declared where site 0 was expected");
    let mut r = op(0, 0, vec![2]);
    r.inputs.push(candle_trace::record::InputRef { seq: 0, reads: candle_trace::record::Reads::Same });
    invalid(&[site(0, "x", "add"), Item::Op(r)], "reads record 0, which is not an earlier one");
    // Shape products that would wrap usize.
    invalid(&[site(0, "x", "add"), Item::Op(op(0, 0, vec![u32::MAX, u32::MAX, u32::MAX]))], "over the caps");
    let mut r = op(0, 0, vec![2]);
    r.dtype = "f7".into();
    invalid(&[site(0, "x", "add"), Item::Op(r)], "unknown dtype");
    invalid(&[Item::Embeddings(vec![vec![1.0], vec![1.0, 2.0]])], "embeddings of different lengths");
    invalid(&[Item::Forward(Forward { step: 0, phase: Phase::Prefill, index_pos: 0, seq_len: 2, batch: 1, ids: vec![1, 2, 3] })], "3 token ids for batch 1 x 2 positions");
    // Regression: positions past u32 (bisect's summary of the pass added them unchecked), with no
    // token ids (a redacted trace) so the ids check above does not catch it first.
    invalid(&[Item::Forward(Forward { step: 3, phase: Phase::Decode, index_pos: u32::MAX, seq_len: 2, batch: u32::MAX, ids: vec![] })], "forward pass 3 covers positions 4294967295..4294967297");
    // Dumped values whose bytes do not fit the shape: a wrapping shape, a short buffer.
    invalid(&[Item::Dump(Dump { seq: 0, dtype: "f32".into(), shape: vec![1 << 31, 1 << 31, 4], shuffled: true, data: vec![0; 16] })], "over the caps");
    invalid(&[Item::Dump(Dump { seq: 0, dtype: "f32".into(), shape: vec![4], shuffled: true, data: vec![0; 15] })], "15 bytes for 4 elements");
    // Found by fuzzing: a header whose batch count would size an allocation.
    let mut h = Header::default();
    h.run.batch = u32::MAX;
    let b = encode_trace(&h, &[], None).unwrap();
    assert!(matches!(refusal(&b), Refusal::Invalid { msg, .. } if msg.contains("batch of 4294967295 rows")));
    // Sequence: records out of order, footer counts.
    match refusal(&bytes(&[site(0, "x", "add"), Item::Op(op(1, 0, vec![2]))])) {
        Refusal::Invalid { msg, .. } => assert!(msg.contains("op record 1 where 0 was expected")),
        r => panic!("{r:?}"),
    }
    let b = encode_trace(&Header::default(), &[site(0, "x", "add")], Some(&Footer { items: 5, ..Footer::default() })).unwrap();
    assert!(matches!(refusal(&b), Refusal::Sequence(m) if m.contains("footer counts 5 items")));
    let mut b = bytes(&[]);
    b.push(0);
    assert!(matches!(refusal(&b), Refusal::Misplaced { what, .. } if what == "1 bytes after the footer frame"));
}

/// A repro trace whose quantized weight is shorter than its shape needs: candle's GGML block
/// reader would read past the buffer. The reader refuses it, so `trace replay` never gets there.
fn short_quantized_repro() -> Vec<Item> {
    let mut r = op(0, 0, vec![1, 4096]);
    r.kernel = Some(Kernel::QMatMul);
    r.operands = vec![1, 2];
    let x = Dump { seq: 1, dtype: "f32".into(), shape: vec![1, 4096], shuffled: true, data: vec![0; 4 * 4096] };
    vec![
        site(0, "layers.0.mlp.up_proj", "qmatmul"),
        Item::Op(r),
        Item::Operand(OperandValue::Tensor(x)),
        Item::Operand(OperandValue::Quantized { id: 2, ggml_dtype: "Q4_1".into(), shape: vec![4096, 4096], data: vec![7; 20] }),
    ]
}

#[test]
fn short_quantized_operand_is_refused_by_replay() {
    match refusal(&bytes(&short_quantized_repro())) {
        Refusal::Invalid { msg, .. } => {
            assert!(msg.contains("20 bytes where Q4_1 of shape [4096, 4096] needs 10485760"), "{msg}")
        }
        r => panic!("{r:?}"),
    }
    let d = tmp();
    let f = d.path().join("repro.trace");
    std::fs::write(&f, bytes(&short_quantized_repro())).unwrap();
    let (code, out, err) = trace_s(&["replay", p(&f)]);
    assert_eq!(code, 2, "{out}{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("trace: error: ") && err.contains("repro.trace") && err.contains("needs 10485760"), "{err}");
    // The same check guards replay itself, for traces built in memory.
    let t = candle_trace::format::Trace {
        path: "mem.trace".into(),
        header: Header::default(),
        items: short_quantized_repro(),
        footer: None,
        truncated: true,
        sampling: Vec::new(),
        build: None,
        level: Default::default(),
        extras: Default::default(),
    };
    let e = candle_trace::replay::replay(&t, None, None, &candle_core::Device::Cpu).unwrap_err().to_string();
    assert!(e.contains("needs 10485760"), "{e}");
    // A quantized weight whose last dimension is not whole blocks.
    let mut items = short_quantized_repro();
    items[3] = Item::Operand(OperandValue::Quantized { id: 2, ggml_dtype: "Q4_1".into(), shape: vec![2, 33], data: vec![0; 40] });
    assert!(matches!(refusal(&bytes(&items)), Refusal::Invalid { msg, .. } if msg.contains("not whole blocks")));
}

#[test]
fn token_index_and_embeddings_from_the_file_do_not_panic() {
    // Token events whose index points past the list, and embeddings without texts in the header.
    let choice = |token| candle_trace::record::Choice { row: 0, token, text: "x".into(), top: vec![], margin: 0.0, tie: false };
    let ev = |token, index| Item::Token(TokenEvent { step: 0, index, pos: 0, rows: vec![choice(token)] });
    let d = tmp();
    let (a, b) = (d.path().join("a.trace"), d.path().join("b.trace"));
    let rec = |digest| {
        let mut r = op(0, 0, vec![1, 1]);
        r.digest = digest;
        r.tokens = vec![TokenStat { row: 0, pos: 0, digest: digest as u64, sum: 0.0, abs_max: 0.0, nonfinite: 0, samples: [0.0; 4] }];
        Item::Op(r)
    };
    std::fs::write(&a, bytes(&[site(0, "x", "add"), rec(1), ev(5, u32::MAX), Item::Embeddings(vec![vec![1.0, 0.0]; 3])])).unwrap();
    std::fs::write(&b, bytes(&[site(0, "x", "add"), rec(2), ev(6, u32::MAX)])).unwrap();
    let (code, out, err) = trace_s(&["bisect", p(&a), p(&b)]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("first generated token that differs") || out.contains("token"), "{out}");
    let (code, out, err) = trace_s(&["show", p(&a)]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("embeddings: 3 texts x 2 dims"), "{out}");
}

/// The address space `trace` gets in [`peak_rss`]: 256 MiB, a hard ceiling (an allocation past
/// it fails and the process aborts, which the test sees as a crash).
const AS_LIMIT: u64 = 256 << 20;

/// Runs `trace` with `args` under an address-space limit of [`AS_LIMIT`] and returns (exit code,
/// stderr, peak RSS in MB). The peak RSS includes the test process's own pages before exec, so
/// it is an upper bound; the address-space limit is what enforces the ceiling.
fn peak_rss(args: &[&str]) -> (i32, String, u64) {
    use std::io::Read;
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_trace"));
    // SAFETY: setrlimit is async-signal-safe; called between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit { rlim_cur: AS_LIMIT as libc::rlim_t, rlim_max: AS_LIMIT as libc::rlim_t };
            if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.args(args).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    let (mut status, mut ru) = (0i32, unsafe { std::mem::zeroed::<libc::rusage>() });
    // SAFETY: wait4 on our own child's pid, with valid out-pointers; the Child is not waited again.
    let r = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut ru) };
    assert_eq!(r, child.id() as i32);
    std::mem::forget(child);
    let code = if libc::WIFEXITED(status) { libc::WEXITSTATUS(status) } else { -1 };
    (code, err, ru.ru_maxrss as u64 / 1024)
}

/// Few-KB files built to expand: many frames of empty value parts; one record with 800 000
/// per-token entries; one forward pass of 2 M token ids; frames that declare 64 MiB.
fn bombs() -> Vec<(&'static str, Vec<u8>)> {
    let mut out = Vec::new();
    let mut parts = preamble().to_vec();
    parts.extend(frame_bytes(KIND_HEADER, &Header::default()).unwrap());
    let empty: Vec<Item> = vec![Item::ValuePart(Vec::new()); 4096];
    let frame = items_frame_bytes(&empty).unwrap();
    while parts.len() + frame.len() < 6000 {
        parts.extend(&frame);
    }
    out.push(("value-parts", parts));
    let mut r = op(0, 0, vec![1, 800_000]);
    r.tokens = vec![TokenStat { row: 0, pos: 0, digest: 0, sum: 0.0, abs_max: 0.0, nonfinite: 0, samples: [0.0; 4] }; 800_000];
    out.push(("token-stats", encode_trace(&Header::default(), &[site(0, "x", "add"), Item::Op(r)], None).unwrap()));
    let ids = Forward { step: 0, phase: Phase::Prefill, index_pos: 0, seq_len: 1 << 21, batch: 1, ids: vec![0; 1 << 21] };
    out.push(("token-ids", encode_trace(&Header::default(), &[Item::Forward(ids)], None).unwrap()));
    let mut big = preamble().to_vec();
    big.extend(frame_bytes(KIND_HEADER, &Header::default()).unwrap());
    big.extend(frame_header(KIND_FOOTER, 8, 64 << 20, 0));
    big.extend([0x28, 0xb5, 0x2f, 0xfd, 0, 0, 0, 0]);
    out.push(("declared-64MiB", big));
    out
}

#[test]
fn few_kb_files_stay_under_256_mb() {
    let d = tmp();
    for (name, b) in bombs() {
        assert!(b.len() < 8 * 1024, "{name}: {} bytes", b.len());
        let f = d.path().join(format!("{name}.trace"));
        std::fs::write(&f, &b).unwrap();
        for args in [vec!["show", p(&f)], vec!["bisect", p(&f), p(&f)]] {
            // Under the 256 MiB address-space limit an allocation past it aborts the process:
            // a clean exit 0, 1 or 2 is the proof. (The peak RSS printed is only an upper bound:
            // it counts the forked test process's pages before exec.)
            let (code, err, mb) = peak_rss(&args);
            assert!((0..=2).contains(&code), "{name} {args:?}: exit {code} (killed or aborted under the 256 MiB limit?)\n{err}");
            assert!(!err.contains("panicked"), "{err}");
            eprintln!("{name} ({} bytes) {}: exit {code}, peak {mb} MB", b.len(), args[0]);
        }
    }
}

/// A trace file's bytes followed by every frame's decompressed payload: what a string search of
/// "the trace" must cover.
fn file_and_payloads(path: &Path) -> Vec<u8> {
    let file = std::fs::read(path).unwrap();
    let mut plain = file.clone();
    let mut at = candle_trace::format::PREAMBLE_LEN;
    while at < file.len() {
        let clen = u32::from_le_bytes(file[at + 1..at + 5].try_into().unwrap()) as usize;
        plain.extend(zstd::bulk::decompress(&file[at + 17..at + 17 + clen], 64 << 20).unwrap());
        at += 17 + clen;
    }
    plain
}

/// The strings a recording must not carry, set in its environment.
const USER: &str = "zq-user-7781";
const HOST: &str = "zq-host-5512";

#[test]
fn recordings_hold_no_user_host_or_home() {
    use std::os::unix::process::CommandExt;
    let d = tmp();
    let home = d.path().join("home").join(USER);
    let model = home.join("finetunes").join(format!("{USER}-bert"));
    std::fs::create_dir_all(&model).unwrap();
    crate::bert::tiny_folder(&model, None);
    // As save_pretrained writes it for a local fine-tune: the folder's absolute path.
    let cfg = std::fs::read_to_string(model.join("config.json")).unwrap();
    let abs = model.canonicalize().unwrap().display().to_string();
    let cfg = cfg.replacen('{', &format!("{{\"_name_or_path\": {abs:?}, \"source_dir\": {:?}, \"owner\": {USER:?}, \"nested\": {{\"user\": {USER:?}}},", format!("{abs}/src")), 1);
    std::fs::write(model.join("config.json"), cfg).unwrap();
    let out = d.path().join("t.trace");
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_trace"));
    cmd.args(["record", "--model", p(&model), "--text", "a b c", "-o", p(&out)])
        .env("HOME", &home)
        .env("USER", USER)
        .env("LOGNAME", USER)
        .env("CANDLE_SECRET", &abs)
        .env("OMP_NUM_THREADS", &abs)
        .current_dir(&home);
    // SAFETY: between fork and exec only async-signal-safe calls (unshare, sethostname).
    unsafe {
        cmd.pre_exec(|| {
            if libc::unshare(libc::CLONE_NEWUTS) != 0 || libc::sethostname(HOST.as_ptr().cast(), HOST.len()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let o = match cmd.output() {
        Ok(o) => o,
        Err(e) if std::env::var("CI").as_deref() != Ok("true") => {
            eprintln!("skipping: cannot set a host name in a new UTS namespace ({e}); needs root");
            return;
        }
        Err(e) => panic!("cannot set a host name in a new UTS namespace on CI: {e}"),
    };
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let plain = file_and_payloads(&out);
    let home_s = home.display().to_string();
    for needle in [USER, HOST, home_s.as_str(), abs.as_str(), "finetunes"] {
        assert!(!plain.windows(needle.len()).any(|w| w == needle.as_bytes()), "{needle:?} is in the trace");
    }
    // What is kept instead: the architecture and sha256 as the name, the variable as set.
    let t = candle_trace::format::read_trace(&out).unwrap();
    assert!(t.header.run.model.name.starts_with("bert-"), "{}", t.header.run.model.name);
    assert!(t.header.env.env_vars.contains(&("OMP_NUM_THREADS".into(), candle_trace::env::UNFIT_VALUE.into())));
    assert!(t.header.run.model.config.iter().any(|(k, _)| k == "hidden_size"));
}

#[test]
fn redacted_copy_holds_no_prompt_and_still_bisects() {
    let d = tmp();
    let (a, r) = (d.path().join("a.trace"), d.path().join("r.trace"));
    let secret = "my secret plan zebra";
    assert_eq!(trace_s(&["record", "--prompt", secret, "--max-tokens", "3", "-o", p(&a)]).0, 0);
    let (code, out, err) = trace_s(&["redact", p(&a), "-o", p(&r)]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("prompt text (20 characters)") && out.contains("prompt token ids") && out.contains("generated text (1 rows)"), "{out}");
    let t = candle_trace::format::read_trace(&r).unwrap();
    assert!(!candle_trace::redact::holds_prompt(&t.header));
    let plain = file_and_payloads(&r);
    assert!(!plain.windows(6).any(|w| w == b"secret"), "prompt text left in the redacted trace");
    let (_, show, _) = trace_s(&["show", p(&r)]);
    assert!(show.contains("prompt       not held"), "{show}");
    // Bisect against the original: identical, by digest.
    let (code, out, err) = trace_s(&["bisect", p(&a), p(&r)]);
    assert_eq!(code, 0, "{out}{err}");
    // --keep prompt keeps it.
    let k = d.path().join("k.trace");
    assert_eq!(trace_s(&["redact", p(&a), "--keep", "prompt", "-o", p(&k)]).0, 0);
    assert_eq!(candle_trace::format::read_trace(&k).unwrap().header.run.prompt, secret);
    // Dumped values go (an embedding row tells its token: a fresh-user trial replayed the
    // embedding of every prompt token from a redacted copy), unless kept; the repro cut from
    // the original keeps its operands, and says so.
    let (dumped, rd, rv) = (d.path().join("dumped.trace"), d.path().join("rd.trace"), d.path().join("rv.trace"));
    assert_eq!(trace_s(&["record", "--prompt", secret, "--max-tokens", "3", "--dump", "layers.0.*", "-o", p(&dumped)]).0, 0);
    let (code, out, err) = trace_s(&["redact", p(&dumped), "-o", p(&rd)]);
    assert!(code == 0 && out.contains("dumped values (") && err.is_empty(), "{out}{err}");
    let values = |f: &Path| candle_trace::format::read_trace(f).unwrap().items.iter().filter(|i| matches!(i, Item::Dump(_) | Item::Operand(_))).count();
    assert_eq!(values(&rd), 0);
    let (code, _, err) = trace_s(&["replay", p(&rd), "--op", "2"]);
    assert!(code == 2 && err.contains("redaction removed the dumped values"), "{err}");
    let (code, _, err) = trace_s(&["redact", p(&dumped), "--keep", "values", "-o", p(&rv)]);
    assert!(code == 0 && err.contains("keeps") && values(&rv) > 0, "{err}");
}

#[test]
fn reports_name_files_not_paths() {
    let d = tmp();
    let sub = d.path().join("deep").join(USER);
    std::fs::create_dir_all(&sub).unwrap();
    let (a, b) = (sub.join("a.trace"), sub.join("b.trace"));
    assert_eq!(trace_s(&["record", "--max-tokens", "2", "-o", p(&a)]).0, 0);
    assert_eq!(trace_s(&["record", "--max-tokens", "2", "--prefill-chunk", "1", "-o", p(&b)]).0, 0);
    for format in ["text", "markdown", "json"] {
        let (_, out, _) = trace_s(&["bisect", p(&a), p(&b), "--format", format]);
        assert!(!out.contains(USER), "{format}: {out}");
        assert!(out.contains("a.trace"), "{format}: {out}");
    }
}

/// A repro whose one op is `kernel` on dense f32/u32 operands of the given shapes.
fn repro(kernel: Kernel, operands: &[(&str, Vec<u32>)]) -> Vec<u8> {
    let mut r = op(0, 0, vec![1]);
    r.kernel = Some(kernel);
    r.operands = (1..=operands.len() as u64).collect();
    let mut items = vec![site(0, "x", "op"), Item::Op(r)];
    for (i, (dtype, shape)) in operands.iter().enumerate() {
        let n = candle_trace::limits::elements(shape).unwrap() as usize * candle_trace::limits::dtype_size(dtype).unwrap();
        items.push(Item::Operand(OperandValue::Tensor(Dump { seq: i as u64 + 1, dtype: dtype.to_string(), shape: shape.clone(), shuffled: true, data: vec![0; n] })));
    }
    bytes(&items)
}

/// Found by a fresh-eyes review: crafted repro operands that made candle panic (empty tensors,
/// rank 0, a dtype the kernel cannot take) or allocate gigabytes (a matmul or broadcast whose
/// output is far larger than its operands). Each is one line naming the file, exit 2.
#[test]
fn replay_refuses_operands_that_do_not_fit_the_op() {
    let d = tmp();
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("empty", repro(Kernel::Softmax { fused: true }, &[("f32", vec![2, 0])]), "is empty"),
        ("rank0", repro(Kernel::Softmax { fused: true }, &[("f32", vec![])]), "rank 1 or more"),
        ("u32", repro(Kernel::Softmax { fused: false }, &[("u32", vec![2, 2])]), "takes a float operand"),
        ("norm", repro(Kernel::RmsNorm { eps: 1e-5 }, &[("f32", vec![2, 0]), ("f32", vec![0])]), "is empty"),
        ("matmul", repro(Kernel::Matmul { rhs_t: true }, &[("f32", vec![16384, 1]), ("f32", vec![16384, 1])]), "over the replay cap"),
        ("broadcast", repro(Kernel::BroadcastAdd, &[("f32", vec![32768, 1]), ("f32", vec![1, 32768])]), "over the replay cap"),
        ("arity", repro(Kernel::LayerNorm { eps: 1e-5 }, &[("f32", vec![2, 2])]), "takes 3 operands"),
    ];
    for (name, b, needle) in cases {
        let f = d.path().join(format!("{name}.trace"));
        std::fs::write(&f, b).unwrap();
        let (code, out, err) = trace_s(&["replay", p(&f)]);
        assert_eq!(code, 2, "{name}: {out}{err}");
        assert_eq!(err.lines().count(), 1, "{name}: {err}");
        assert!(err.contains(&format!("{name}.trace")) && err.contains(needle), "{name}: {err}");
    }
}

/// Found by a fresh-eyes review: strings from a crafted trace (a model name holding ESC and a
/// fake report line) are printed escaped, never raw; a device file is refused, not read forever;
/// summaries name files, not the paths as typed.
#[test]
fn crafted_strings_devices_and_paths() {
    let d = tmp();
    let mut h = Header::default();
    h.run.model.name = "m\u{1b}[2J\nverdict: identical".into();
    h.run.model.sha256 = "s".into();
    // A newline and a typed backslash-n stay told apart.
    h.run.prompt = "a\u{1b}[2J\nverdict: identical \\n".into();
    let sub = d.path().join(USER);
    std::fs::create_dir_all(&sub).unwrap();
    let f = sub.join("esc.trace");
    std::fs::write(
        &f,
        encode_trace(&h, &[site(0, "p\u{1b}x", "add"), Item::Op(op(0, 0, vec![1]))], Some(&Footer { items: 2, op_records: 1, stop: "\u{1b}[31mred".into(), ..Footer::default() })).unwrap(),
    )
    .unwrap();
    for args in [vec!["show", p(&f)], vec!["show", "--sites", p(&f)], vec!["bisect", p(&f), p(&f)]] {
        let (_, out, _) = trace_s(&args);
        assert!(!out.contains('\u{1b}'), "{args:?}: raw ESC in\n{out}");
        assert!(!out.lines().any(|l| l.starts_with("verdict: identical") && args[0] == "show"), "{args:?}: a fake line\n{out}");
        assert!(!out.contains(USER), "{args:?}: the typed path in\n{out}");
    }
    let (_, out, _) = trace_s(&["show", p(&f)]);
    assert!(out.contains(r#"prompt       "a\u{1b}[2J\nverdict: identical \\n""#), "{out}");
    let (code, _, err) = trace_s(&["show", "/dev/zero"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("not a regular file"), "{err}");
}

/// Found by a fresh-eyes review: a redacted copy held the generated token ids, and a redacted
/// batch paired the wrong rows; `extract` overwrote its own input, and `redact` an input behind
/// a hard link; a truncated run compared as "identical" with exit 0.
#[test]
fn redaction_pairing_overwrites_and_truncation() {
    let d = tmp();
    let (solo, batch, red) = (d.path().join("solo.trace"), d.path().join("batch.trace"), d.path().join("red.trace"));
    assert_eq!(trace_s(&["record", "--prompt", "Hi there", "--max-tokens", "4", "-o", p(&solo)]).0, 0);
    assert_eq!(trace_s(&["record", "--prompt", "A much longer prompt", "--prompt", "Hi there", "--prompt", "Other one", "--max-tokens", "4", "-o", p(&batch)]).0, 0);
    assert_eq!(trace_s(&["redact", p(&batch), "-o", p(&red)]).0, 0);
    let t = candle_trace::format::read_trace(&red).unwrap();
    for item in &t.items {
        if let Item::Token(e) = item {
            assert!(e.rows.iter().all(|c| c.token == 0 && c.top.is_empty() && c.text.is_empty()), "generated ids left: {e:?}");
        }
    }
    assert_eq!(t.sampling.len(), 12, "sampling records kept");
    assert!(t.sampling.iter().all(|x| x.chosen == 0));
    let (_, out, _) = trace_s(&["bisect", p(&solo), p(&red), "--format", "json"]);
    let v = crate::util::json(&out);
    assert_eq!((v["rows"][0]["a_row"].as_u64(), v["rows"][0]["b_row"].as_u64()), (Some(0), Some(1)), "{v}");
    assert!(v["inputs_differ"].is_null(), "{v}");
    // The redacted copy still bisects as identical against its original.
    assert_eq!(trace_s(&["bisect", p(&batch), p(&red)]).0, 0);
    // Its per-request line says why no token was compared there and what was: the logits.
    let (_, text, _) = trace_s(&["bisect", p(&solo), p(&red)]);
    assert!(text.contains("a row 0 = b row 1 \"Hi there\": its tokens are not compared here (a redacted trace holds no ids") && text.contains("over 4 steps"), "{text}");
    assert!(!text.contains("no output compared"), "{text}");
    // A request alone against the same one in row 0 of a batch still gets its answer first.
    let first = d.path().join("first.trace");
    assert_eq!(trace_s(&["record", "--prompt", "A much longer prompt", "--max-tokens", "4", "-o", p(&first)]).0, 0);
    let (_, text, _) = trace_s(&["bisect", p(&first), p(&batch)]);
    assert!(text.contains("\nper request:\n  row 0 \"A much longer prompt\": "), "{text}");
    // Redacting it again finds nothing left (samples and values already zero are not recounted).
    let (code, out, err) = trace_s(&["redact", p(&red), "-o", p(&d.path().join("red2.trace"))]);
    assert_eq!(code, 0, "{err}");
    assert!(out.ends_with(": nothing left to remove (already redacted?)\n"), "{out}");
    // Overwrites.
    let (code, _, err) = trace_s(&["extract", p(&solo), p(&batch), "-o", p(&solo)]);
    assert_eq!(code, 2, "{err}");
    let link = d.path().join("link.trace");
    std::fs::hard_link(&batch, &link).unwrap();
    let (code, _, err) = trace_s(&["redact", p(&batch), "-o", p(&link)]);
    assert_eq!(code, 2, "{err}");
    // A truncated run is not a pass.
    let bytes = std::fs::read(&solo).unwrap();
    let cut = d.path().join("cut.trace");
    std::fs::write(&cut, &bytes[..bytes.len() * 2 / 3]).unwrap();
    let (code, out, _) = trace_s(&["bisect", p(&solo), p(&cut)]);
    assert_eq!(code, 1, "{out}");
    assert!(out.starts_with("verdict: incomplete"), "{out}");
}

/// Every string a crafted trace can put in a bisect report reaches the terminal escaped, the
/// markdown as cells and the HTML as text: module paths (the root, a fork in the op graph, its
/// inputs), op names, dtypes, header fields and the build fingerprint's values. Two traces whose
/// op graphs part (`p…` in a, `q…` in b feed the same output) so the fork section renders.
#[test]
fn crafted_strings_in_every_report_section_are_escaped() {
    use candle_trace::format::{frame_bytes, items_frame_bytes, KIND_BUILD};
    const EVIL: &str = "\u{1b}[2J\u{1b}]8;;x\u{7}<b>|`";
    let d = tmp();
    let write = |name: &str, fork: &str, digest: u128, crate_version: &str| {
        let mut h = Header::default();
        h.run.model.sha256 = "s".into();
        h.run.model.name = format!("m{EVIL}");
        h.run.dtype = format!("f32{fork}{EVIL}");
        let rec = |seq: u64, site: u32, input: Option<u64>, digest: u128| {
            let mut r = op(seq, site, vec![1, 1]);
            r.dtype = "f32".into();
            r.digest = digest;
            r.tokens = vec![TokenStat { row: 0, pos: 0, digest: digest as u64, sum: digest as f64, abs_max: 0.0, nonfinite: 0, samples: [0.0; 4] }];
            r.axis = Some(candle_trace::record::TokenAxis { seq_dim: None, first_pos: 0, keep_from: 0, causal: false });
            r.inputs = input.map(|seq| candle_trace::record::InputRef { seq, reads: candle_trace::record::Reads::Same }).into_iter().collect();
            Item::Op(r)
        };
        let items = vec![
            site(0, &format!("layers.0.emb{EVIL}"), &format!("add{EVIL}")),
            site(1, &format!("layers.0.{fork}{EVIL}"), "add"),
            site(2, &format!("layers.0.out{EVIL}"), "add"),
            rec(0, 0, None, 1),
            rec(1, 1, Some(0), 2),
            rec(2, 2, Some(1), digest),
        ];
        let build = candle_trace::record::BuildInfo { crates: vec![(format!("gemm{EVIL}"), crate_version.into())], ..Default::default() };
        let mut bytes = preamble().to_vec();
        bytes.extend(frame_bytes(KIND_HEADER, &h).unwrap());
        bytes.extend(frame_bytes(KIND_BUILD, &build).unwrap());
        bytes.extend(items_frame_bytes(&items).unwrap());
        bytes.extend(frame_bytes(KIND_FOOTER, &Footer { items: 6, op_records: 3, ..Footer::default() }).unwrap());
        let f = d.path().join(name);
        std::fs::write(&f, bytes).unwrap();
        f
    };
    let (a, b) = (write("a.trace", "p", 3, &format!("1{EVIL}")), write("b.trace", "q", 4, &format!("2{EVIL}")));
    let (code, text, err) = trace_s(&["bisect", p(&a), p(&b)]);
    assert_eq!(code, 1, "{text}{err}");
    assert!(text.contains("the op graphs differ here") && text.contains("build.crate.gemm"), "the fork and build sections render:\n{text}");
    let (_, md, _) = trace_s(&["bisect", "--format", "markdown", p(&a), p(&b)]);
    let html = d.path().join("r.html");
    let (_, _, err) = trace_s(&["report", p(&a), p(&b), "-o", p(&html)]);
    let html = std::fs::read_to_string(&html).unwrap_or_else(|e| panic!("{e}: {err}"));
    // Markdown outside fenced code blocks (the reproduce commands are shell-quoted in one, where
    // GitHub renders no HTML).
    let md: String = md.split("```").step_by(2).collect::<Vec<_>>().join("\n");
    for (what, out) in [("text", &text), ("markdown", &md), ("html", &html)] {
        assert!(!out.contains('\u{1b}') && !out.contains('\u{7}'), "{what}: a raw control character in\n{out}");
        assert!(what == "text" || !out.contains("<b>"), "{what}: raw HTML from the trace in\n{out}");
    }
    assert!(!md.contains("<b>|`"), "markdown: an unescaped cell in\n{md}");
}
