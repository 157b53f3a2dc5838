//! `--device`: which candle device a run uses, how it is named in a trace header, and what is
//! known of a GPU (its name and driver version) for the header's environment.

use candle_core::Device;
use candle_trace_format::error::{Error, Result};

/// The kinds of device candle runs on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceKind {
    /// The CPU (always available).
    #[default]
    Cpu,
    /// An NVIDIA GPU (a build with `--features cuda`).
    Cuda,
    /// An Apple GPU (a build with `--features metal`).
    Metal,
}

/// A `--device` value: `cpu`, `cuda`, `cuda:N`, `metal` or `metal:N` (`N` the device ordinal,
/// 0 when omitted). Parsed with [`str::parse`]; shown as `cpu`, `cuda:N`, `metal:N`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceSpec {
    /// CPU, CUDA or Metal.
    pub kind: DeviceKind,
    /// Device ordinal among the visible devices of that kind (0 for the CPU).
    pub ordinal: usize,
}

impl std::str::FromStr for DeviceSpec {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let bad = || "expected cpu, cuda, cuda:N, metal or metal:N".to_string();
        let (kind, ordinal) = match s.split_once(':') {
            Some((k, n)) => (k, n.parse::<usize>().map_err(|_| bad())?),
            None => (s, 0),
        };
        let kind = match kind {
            "cpu" if ordinal == 0 => DeviceKind::Cpu,
            "cuda" => DeviceKind::Cuda,
            "metal" => DeviceKind::Metal,
            _ => return Err(bad()),
        };
        Ok(DeviceSpec { kind, ordinal })
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.kind {
            DeviceKind::Cpu => f.write_str("cpu"),
            DeviceKind::Cuda => write!(f, "cuda:{}", self.ordinal),
            DeviceKind::Metal => write!(f, "metal:{}", self.ordinal),
        }
    }
}

impl DeviceSpec {
    /// Opens the device.
    ///
    /// # Errors
    /// [`Error::Usage`] naming the device when this build or machine cannot open it (a build
    /// without the `cuda`/`metal` feature, or no such GPU), with candle's first line of reason.
    pub fn open(&self) -> Result<Device> {
        let (dev, feature) = match self.kind {
            DeviceKind::Cpu => return Ok(Device::Cpu),
            DeviceKind::Cuda => (Device::new_cuda(self.ordinal), "cuda"),
            DeviceKind::Metal => (Device::new_metal(self.ordinal), "metal"),
        };
        dev.map_err(|e| {
            let msg = e.to_string();
            let why = msg.lines().next().unwrap_or("");
            let built = (matches!(self.kind, DeviceKind::Cuda) && cfg!(feature = "cuda")) || (matches!(self.kind, DeviceKind::Metal) && cfg!(feature = "metal"));
            let hint = if built { "no such GPU, or its driver is not usable".to_string() } else { format!("build with --features {feature} on a machine that has one") };
            Error::usage(format!("--device {self}: {why} ({hint})"))
        })
    }
}

/// The device as recorded in trace headers ([`candle_trace_format::record::EnvInfo::device`]): `cpu`, or
/// `cuda:N` / `metal:N` followed, for a CUDA device, by what is known of the GPU in parentheses:
/// `cuda:0 (NVIDIA H200, sm 9.0, driver 550.54.15, CUDA 12.4, cuBLAS 120402, gemm reduced
/// precision: f16 bf16)` ([`gpu_facts`], and under the `cuda` feature the driver's CUDA
/// version, cuBLAS's, and candle's cuBLAS settings that change numerics).
pub fn device_name(d: &Device) -> String {
    match d.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => {
            let facts = [gpu_facts(gpu_id, std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref()), cuda_settings(d)].into_iter().filter(|f| !f.is_empty()).collect::<Vec<_>>().join(", ");
            if facts.is_empty() {
                format!("cuda:{gpu_id}")
            } else {
                format!("cuda:{gpu_id} ({facts})")
            }
        }
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

/// The name, compute capability and driver version of the CUDA device with visible ordinal `ordinal`, as
/// `NAME, sm CAP, driver VERSION`, from `nvidia-smi` (empty when it is not installed or says nothing
/// usable). A numeric `CUDA_VISIBLE_DEVICES` maps the ordinal to the physical index `nvidia-smi`
/// uses. Only a name of letters, digits, spaces and `-_.()` (at most 64 characters) and a
/// version of digits and dots are kept: nothing else of the machine reaches a header. The CUDA
/// toolkit the build compiled against is in the build fingerprint (`cuda-toolkit`).
pub fn gpu_facts(ordinal: usize, visible: Option<&str>) -> String {
    let index = match visible.map(str::trim).filter(|v| !v.is_empty()) {
        Some(v) => match v.split(',').nth(ordinal).map(str::trim) {
            Some(i) if !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit()) => i.to_string(),
            _ => return String::new(),
        },
        None => ordinal.to_string(),
    };
    let out =
        std::process::Command::new("nvidia-smi").args(["--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader,nounits", "-i", &index]).stderr(std::process::Stdio::null()).output();
    match out {
        Ok(o) if o.status.success() => parse_smi_line(&String::from_utf8_lossy(&o.stdout)),
        _ => String::new(),
    }
}

/// `NAME, CAP, VERSION` (one `nvidia-smi` CSV line) as `NAME, sm CAP, driver VERSION`, each part
/// kept only when it has the expected characters ([`gpu_facts`]).
fn parse_smi_line(line: &str) -> String {
    let mut parts = line.lines().next().unwrap_or("").split(',').map(str::trim);
    let (name, cap, driver) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let version = |v: &str| !v.is_empty() && v.len() <= 32 && v.bytes().all(|b| b.is_ascii_digit() || b == b'.');
    let name_ok = !name.is_empty() && name.len() <= 64 && name.chars().all(|c| c.is_ascii_alphanumeric() || " -_.()".contains(c));
    let kept = [(name_ok, name.to_string()), (version(cap), format!("sm {cap}")), (version(driver), format!("driver {driver}"))];
    kept.into_iter().filter(|k| k.0).map(|k| k.1).collect::<Vec<_>>().join(", ")
}

/// Under the `cuda` feature, for a CUDA device: the CUDA version its driver supports, the
/// cuBLAS library version, and candle's process-wide cuBLAS settings that change numerics (which
/// gemm dtypes may use reduced-precision reductions; f32: TF32), as
/// `CUDA 13.0, cuBLAS 130100, gemm reduced precision: f16 bf16`. Empty in other builds.
#[allow(unused_variables)]
fn cuda_settings(d: &Device) -> String {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = d {
        use candle_core::cuda_backend as c;
        let mut facts = Vec::new();
        let mut v: std::ffi::c_int = 0;
        // SAFETY: each call writes one int through a pointer to a live local.
        if unsafe { c::cudarc::driver::sys::cuDriverGetVersion(&mut v) } == c::cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            facts.push(format!("CUDA {}.{}", v / 1000, v % 1000 / 10));
        }
        let blas = dev.cublas_handle();
        if unsafe { c::cudarc::cublas::sys::cublasGetVersion_v2(*blas.handle(), &mut v) } == c::cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            facts.push(format!("cuBLAS {v}"));
        }
        let on: Vec<&str> =
            [("f32", c::gemm_reduced_precision_f32()), ("f16", c::gemm_reduced_precision_f16()), ("bf16", c::gemm_reduced_precision_bf16())].iter().filter(|x| x.1).map(|x| x.0).collect();
        facts.push(format!("gemm reduced precision: {}", if on.is_empty() { "none".to_string() } else { on.join(" ") }));
        return facts.join(", ");
    }
    String::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_specs_parse_and_show() {
        let p = |s: &str| s.parse::<DeviceSpec>();
        assert_eq!(p("cpu").unwrap().to_string(), "cpu");
        assert_eq!(p("cuda").unwrap().to_string(), "cuda:0");
        assert_eq!(p("cuda:3").unwrap(), DeviceSpec { kind: DeviceKind::Cuda, ordinal: 3 });
        assert_eq!(p("metal").unwrap().to_string(), "metal:0");
        for bad in ["", "gpu", "cuda:", "cuda:x", "cpu:1", "cuda:-1"] {
            assert!(p(bad).is_err(), "{bad}");
        }
        assert!(DeviceSpec::default().open().is_ok());
    }

    #[test]
    fn gpu_facts_keep_only_expected_characters() {
        assert_eq!(parse_smi_line("NVIDIA H200, 9.0, 550.54.15\n"), "NVIDIA H200, sm 9.0, driver 550.54.15");
        assert_eq!(parse_smi_line("NVIDIA GeForce RTX 4090 (alice's), 8.9, 550.54.15"), "sm 8.9, driver 550.54.15");
        assert_eq!(parse_smi_line("Tesla T4, 7.5, /home/alice"), "Tesla T4, sm 7.5");
        assert_eq!(parse_smi_line(""), "");
        // A CUDA_VISIBLE_DEVICES that is not a list of indices (UUIDs) gives nothing.
        assert_eq!(gpu_facts(0, Some("GPU-8a1b")), "");
        assert_eq!(gpu_facts(2, Some("0,1")), "");
    }
}
