//! One loader for Hugging Face model folders, decoders and encoders alike: `config.json`, then
//! the weights, `model.safetensors` or the shards a `model.safetensors.index.json` names
//! (its `weight_map`, as `transformers`' `save_pretrained` writes it).
//!
//! The weights are memory-mapped once; their headers (name, dtype, shape of every tensor) are
//! read and checked by the `safetensors` crate through candle's [`MmapedSafetensors`], which
//! also backs the [`VarBuilder`] the architecture loaders read tensors from. How a folder is
//! named and hashed in a trace header ([`Weights::info`]) is the same for every architecture.

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use candle_trace_format::error::{Error, Result};
use candle_trace_format::record::ModelInfo;
use std::path::{Path, PathBuf};

/// A model folder whose `config.json` was read and parsed.
#[derive(Debug)]
pub struct Folder {
    /// The folder as given.
    pub dir: PathBuf,
    /// `dir/config.json`.
    pub config_path: PathBuf,
    /// `config.json`'s contents.
    pub config: serde_json::Value,
}

/// The largest JSON file of a model folder read (config, index, tokenizer config, modules).
pub const MAX_JSON_BYTES: u64 = 64 << 20;

/// Reads a JSON file: a regular file of at most [`MAX_JSON_BYTES`].
///
/// # Errors
/// [`Error::Io`] when it cannot be read; [`Error::Model`] naming the file when it is not a
/// regular file, is too large, or is not JSON.
pub fn read_json(path: &Path) -> Result<serde_json::Value> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let meta = file.metadata().map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        return Err(Error::model(path, "not a regular file"));
    }
    if meta.len() > MAX_JSON_BYTES {
        return Err(Error::model(path, format!("{} bytes: over the {} MiB a JSON file of a model folder may have", meta.len(), MAX_JSON_BYTES >> 20)));
    }
    let mut text = String::new();
    file.take(MAX_JSON_BYTES).read_to_string(&mut text).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::model(path, format!("invalid JSON: {e}")))
}

impl Folder {
    /// Opens `dir`: it must be a folder holding a `config.json` that parses as JSON.
    ///
    /// # Errors
    /// [`Error::Model`], one line naming the folder or file: no such folder, not a folder (the
    /// message says what a model folder holds), no `config.json`, invalid JSON.
    pub fn open(dir: &Path) -> Result<Folder> {
        if !dir.exists() {
            return Err(Error::model(dir, "no such folder"));
        }
        if !dir.is_dir() {
            return Err(Error::model(dir, "not a folder; expected a Hugging Face model folder with config.json"));
        }
        let config_path = dir.join("config.json");
        if !config_path.is_file() {
            return Err(Error::model(dir, "no config.json in this folder (expected a Hugging Face model folder)"));
        }
        let config = read_json(&config_path)?;
        Ok(Folder { dir: dir.to_path_buf(), config_path, config })
    }

    /// The architecture the folder declares: `model_type`, else the first `architectures` entry
    /// lower-cased (`Qwen2ForCausalLM` → `qwen2`, matched against `known` prefixes); empty when
    /// it declares neither.
    pub fn architecture(&self, known: &[&str]) -> String {
        let from_arch = self.config["architectures"].get(0).and_then(|a| a.as_str()).map(|a| {
            let a = a.to_ascii_lowercase();
            known.iter().find(|k| a.starts_with(**k)).map_or(a.clone(), |k| k.to_string())
        });
        self.config["model_type"].as_str().map(str::to_string).or(from_arch).unwrap_or_default()
    }

    /// The safetensors files: `model.safetensors`, or the shards named by
    /// `model.safetensors.index.json`, sorted and deduplicated.
    ///
    /// # Errors
    /// [`Error::Model`] when there is neither file, the index is not JSON or has no
    /// `weight_map`, or names a shard that is missing or outside the folder.
    pub fn safetensors_files(&self) -> Result<Vec<PathBuf>> {
        let single = self.dir.join("model.safetensors");
        if single.is_file() {
            return Ok(vec![single]);
        }
        let index = self.dir.join("model.safetensors.index.json");
        if !index.is_file() {
            return Err(Error::model(&self.dir, "folder has neither model.safetensors nor model.safetensors.index.json"));
        }
        let v = read_json(&index)?;
        let map = v["weight_map"].as_object().ok_or_else(|| Error::model(&index, "no weight_map"))?;
        let mut names: Vec<&str> = Vec::with_capacity(map.len());
        for f in map.values() {
            let name = f.as_str().ok_or_else(|| Error::model(&index, "a weight_map entry is not a file name"))?;
            // A shard is a file of this folder: a name with a separator or `..` could reach any file.
            if name.is_empty() || name.contains(['/', '\\']) || name == ".." {
                return Err(Error::model(&index, format!("weight_map names {name:?}, not a file of this folder")));
            }
            names.push(name);
        }
        names.sort_unstable();
        names.dedup();
        let files: Vec<PathBuf> = names.into_iter().map(|n| self.dir.join(n)).collect();
        if let Some(f) = files.iter().find(|f| !f.is_file()) {
            return Err(Error::model(f, "shard named by model.safetensors.index.json is missing"));
        }
        Ok(files)
    }

    /// Maps the weights ([`Folder::safetensors_files`]) and reads their headers.
    ///
    /// # Errors
    /// As [`Folder::safetensors_files`]; [`Error::Model`] naming the folder when a file is not a
    /// valid safetensors file (the `safetensors` crate's checks: header length at most 100 MB,
    /// JSON, offsets inside the file and in order).
    pub fn weights(&self) -> Result<Weights> {
        let files = self.safetensors_files()?;
        // SAFETY: the files are memory-mapped read-only; as everywhere with mmap, they must not be
        // truncated while mapped (candle's loader requires `unsafe` for that reason).
        let st = unsafe { MmapedSafetensors::multi(&files) }.map_err(|e| {
            let msg = e.to_string();
            Error::model(&self.dir, format!("cannot read safetensors: {}", msg.lines().next().unwrap_or("")))
        })?;
        // One tensor in two shards: which copy loads would depend on file names. Refused.
        let mut seen = std::collections::HashSet::new();
        if let Some((name, _)) = st.tensors().into_iter().find(|(name, _)| !seen.insert(name.clone())) {
            return Err(Error::model(&self.dir.join("model.safetensors.index.json"), format!("tensor {name} is in two shards")));
        }
        let origin = if files.len() == 1 { files[0].clone() } else { self.dir.join("model.safetensors.index.json") };
        Ok(Weights { files, origin, st })
    }
}

/// A folder's memory-mapped safetensors files.
pub struct Weights {
    /// The files, sorted (one, or the shards).
    pub files: Vec<PathBuf>,
    /// The file an error about a tensor names: the single file, or the shards' index.
    pub origin: PathBuf,
    st: MmapedSafetensors,
}

impl Weights {
    /// True when some file holds tensor `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.st.get(name).is_ok()
    }

    /// How tensor `name` is stored (`F32`, `BF16`, `I64`…), or `None` when no file holds it.
    pub fn stored_dtype(&self, name: &str) -> Option<safetensors::Dtype> {
        self.st.get(name).ok().map(|v| v.dtype())
    }

    /// Describes the weights in a trace header: `name` is [`super::folder_name`] (never the
    /// folder's own name), `size` the total bytes, `sha256` that of the single file, or, for
    /// shards, of the lines `FILE_NAME SHA256\n` in file-name order. `config` is `config.json`
    /// flattened ([`super::flatten_config`]).
    ///
    /// # Errors
    /// [`Error::Io`] when a file cannot be read.
    pub fn info(&self, folder: &Folder, arch: &str, n_layers: usize, vocab: usize, weights: String) -> Result<ModelInfo> {
        let mut size = 0;
        let mut lines = String::new();
        let mut single = String::new();
        for f in &self.files {
            let (sha, n) = super::gguf::sha256_file(f)?;
            size += n;
            lines.push_str(&format!("{} {sha}\n", f.file_name().map(|n| n.to_string_lossy()).unwrap_or_default()));
            single = sha;
        }
        let sha256 = if self.files.len() == 1 {
            single
        } else {
            use sha2::Digest;
            candle_trace_compare::text::hex(&sha2::Sha256::digest(lines.as_bytes()))
        };
        Ok(ModelInfo {
            name: super::folder_name(arch, &sha256),
            size,
            sha256,
            architecture: arch.into(),
            n_layers: n_layers as u32,
            vocab_size: vocab as u32,
            weights,
            config: super::flatten_config(&folder.config),
        })
    }

    /// A [`VarBuilder`] over the mapped files that converts each tensor to `dtype` on `device`.
    pub fn into_var_builder(self, dtype: DType, device: &Device) -> VarBuilder<'static> {
        VarBuilder::from_backend(Box::new(self.st), dtype, device.clone())
    }
}
