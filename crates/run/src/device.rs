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
            Error::usage(format!("--device {self}: {why} (build with --features {feature} on a machine that has one)"))
        })
    }
}

/// The device as recorded in trace headers ([`candle_trace_format::record::EnvInfo::device`]): `cpu`, or
/// `cuda:N` / `metal:N` followed, for a CUDA device, by what is known of the GPU in parentheses:
/// `cuda:0 (NVIDIA H200, driver 550.54.15)` ([`gpu_facts`]).
pub fn device_name(d: &Device) -> String {
    match d.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => {
            let facts = gpu_facts(gpu_id, std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref());
            if facts.is_empty() {
                format!("cuda:{gpu_id}")
            } else {
                format!("cuda:{gpu_id} ({facts})")
            }
        }
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

/// The name and driver version of the CUDA device with visible ordinal `ordinal`, as
/// `NAME, driver VERSION`, from `nvidia-smi` (empty when it is not installed or says nothing
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
    let out = std::process::Command::new("nvidia-smi").args(["--query-gpu=name,driver_version", "--format=csv,noheader,nounits", "-i", &index]).stderr(std::process::Stdio::null()).output();
    match out {
        Ok(o) if o.status.success() => parse_smi_line(&String::from_utf8_lossy(&o.stdout)),
        _ => String::new(),
    }
}

/// `NAME, VERSION` (one `nvidia-smi` CSV line) as `NAME, driver VERSION`, each part kept only
/// when it has the expected characters ([`gpu_facts`]).
fn parse_smi_line(line: &str) -> String {
    let mut parts = line.lines().next().unwrap_or("").split(',').map(str::trim);
    let name = parts.next().unwrap_or("");
    let driver = parts.next().unwrap_or("");
    let name_ok = !name.is_empty() && name.len() <= 64 && name.chars().all(|c| c.is_ascii_alphanumeric() || " -_.()".contains(c));
    let driver_ok = !driver.is_empty() && driver.len() <= 32 && driver.bytes().all(|b| b.is_ascii_digit() || b == b'.');
    match (name_ok, driver_ok) {
        (true, true) => format!("{name}, driver {driver}"),
        (true, false) => name.to_string(),
        (false, true) => format!("driver {driver}"),
        (false, false) => String::new(),
    }
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
        assert_eq!(parse_smi_line("NVIDIA H200, 550.54.15\n"), "NVIDIA H200, driver 550.54.15");
        assert_eq!(parse_smi_line("NVIDIA GeForce RTX 4090 (alice's), 550.54.15"), "driver 550.54.15");
        assert_eq!(parse_smi_line("Tesla T4, /home/alice"), "Tesla T4");
        assert_eq!(parse_smi_line(""), "");
        // A CUDA_VISIBLE_DEVICES that is not a list of indices (UUIDs) gives nothing.
        assert_eq!(gpu_facts(0, Some("GPU-8a1b")), "");
        assert_eq!(gpu_facts(2, Some("0,1")), "");
    }
}
