//! Intel MKL's products, loaded at run time: on a CPU with AMX, MKL runs bf16 products
//! (`cblas_gemm_bf16bf16f32`) on the tile unit, which does about 16x the bf16 operations per
//! cycle of AVX512-BF16's dot products ([`super::gemm_bf16`]); PyTorch's bf16 products reach
//! AMX the same way (oneDNN/MKL).
//!
//! Why a vendor library and not our own tile kernel: the AMX intrinsics are nightly-only, so a
//! kernel of our own means inline `asm!` for tile configuration, loads, `tdpbf16ps` and stores,
//! plus the Linux permission request for tile state (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), none
//! of which can run (or be tested) on a CPU without AMX, where MKL runs its AVX2/AVX-512 paths
//! and gives the same products: this module is tested wherever MKL loads. MKL requests the tile
//! permission itself.
//!
//! Nothing links against MKL: `libmkl_rt` is opened with `dlopen` when a product first asks for
//! it (`FLASH_RING_MKL` names the file, e.g. the `mkl` wheel's
//! `lib/libmkl_rt.so.3`; otherwise the loader's search path is tried), so the default build has
//! no dependency and a machine without MKL keeps flash-ring's kernels.
//!
//! Which products use it ([`Gemm`], `FLASH_RING_GEMM`): under `auto` (the default) bf16
//! products run on MKL where the CPU has AMX-BF16 and MKL loads, and everything else stays on
//! flash-ring's kernels (f32 has no AMX path, and flash-ring's short chains are more exact at
//! the same speed); `mkl` sends f32 and bf16 products to MKL whatever the CPU (an error if MKL
//! does not load); `native` never uses it.
//!
//! Rounding and determinism: MKL multiplies with f32 accumulation in one chain per output over
//! the whole depth `k` (the bound `k u sum |a b|`, not flash-ring's `(64 + k / 64 + 2) u sum
//! |a b|`: see docs/accuracy.md); bf16 products are exact in f32 as in [`super::gemm_bf16`].
//! MKL runs sequentially (its threading layer set to `SEQUENTIAL`) on tiles of C of a fixed size
//! ([`TILE_ROWS`] x [`TILE_COLS`]) that rayon spreads over the threads, and with conditional
//! numerical reproducibility (`MKL_CBWR_AUTO | MKL_CBWR_STRICT`), so results depend only on the
//! shapes and the machine, never on the thread count or the operands' alignment.

use std::ffi::{c_char, c_int};
use std::sync::OnceLock;

use half::bf16;
use rayon::prelude::*;

use super::gemm::{to_row_major, trivial_product, Mat, OutPtr};
use crate::error::{Error, Result};

/// Rows of C per MKL call (a fixed grid: results do not depend on the thread count).
pub const TILE_ROWS: usize = 256;
/// Columns of C per MKL call.
pub const TILE_COLS: usize = 2048;

/// The environment variable naming `libmkl_rt`.
pub const MKL_ENV: &str = "FLASH_RING_MKL";
/// The environment variable choosing the products' library (`auto`, `native`, `mkl`).
pub const GEMM_ENV: &str = "FLASH_RING_GEMM";

const CBLAS_ROW_MAJOR: c_int = 101;
const CBLAS_NO_TRANS: c_int = 111;
const CBLAS_TRANS: c_int = 112;
const MKL_THREADING_SEQUENTIAL: c_int = 1;
const MKL_INTERFACE_LP64: c_int = 0;
const MKL_CBWR_AUTO: c_int = 2;
const MKL_CBWR_STRICT: c_int = 0x10000;
const MKL_CBWR_SUCCESS: c_int = 0;

/// `cblas_sgemm` (`E = f32`) and `cblas_gemm_bf16bf16f32` (`E = bf16`, MKL's `MKL_BF16`: `bf16`
/// is `repr(transparent)` over the same 16 bits): layout, transposes, m, n, k, alpha, A, lda, B,
/// ldb, beta, C (f32), ldc.
pub type GemmFn<E> = unsafe extern "C" fn(
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    f32,
    *const E,
    c_int,
    *const E,
    c_int,
    f32,
    *mut f32,
    c_int,
);
type SetLayer = unsafe extern "C" fn(c_int) -> c_int;
type VersionString = unsafe extern "C" fn(*mut c_char, c_int);

/// Which library computes flash-ring's dense CPU products ([`crate::matmul`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Gemm {
    /// `FLASH_RING_GEMM` when set, otherwise MKL for bf16 on a CPU with AMX-BF16 where MKL
    /// loads, flash-ring's kernels for the rest.
    #[default]
    Auto,
    /// flash-ring's kernels ([`super::gemm`], [`super::gemm_bf16`]).
    Native,
    /// MKL for f32 and bf16 products (f16 is widened to f32 first); an error if it does not
    /// load.
    Mkl,
}

/// A loaded `libmkl_rt`.
pub struct Mkl {
    // Keeps the library mapped while the function pointers below are in use (for the process).
    _lib: libloading::Library,
    sgemm: GemmFn<f32>,
    gemm_bf16: GemmFn<bf16>,
    /// The file it was opened from (as given, or the soname the loader found).
    pub path: String,
    /// MKL's own version string.
    pub version: String,
}

impl std::fmt::Debug for Mkl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mkl")
            .field("path", &self.path)
            .field("version", &self.version)
            .finish()
    }
}

impl Mkl {
    /// Opens `libmkl_rt` at `path` and sets it up (LP64 interface, sequential threading,
    /// strict reproducibility). The error names the file and what failed.
    pub fn open(path: &str) -> std::result::Result<Mkl, String> {
        // SAFETY: loading MKL runs its initialisers, which have no preconditions.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| e.to_string())?;
        // SAFETY: each symbol is looked up with the C signature MKL's headers declare for it.
        unsafe {
            let sgemm = symbol::<GemmFn<f32>>(&lib, b"cblas_sgemm\0")?;
            let gemm_bf16 = symbol::<GemmFn<bf16>>(&lib, b"cblas_gemm_bf16bf16f32\0")?;
            let interface = symbol::<SetLayer>(&lib, b"MKL_Set_Interface_Layer\0")?;
            let threading = symbol::<SetLayer>(&lib, b"MKL_Set_Threading_Layer\0")?;
            let cbwr = symbol::<SetLayer>(&lib, b"MKL_CBWR_Set\0")?;
            let version = symbol::<VersionString>(&lib, b"MKL_Get_Version_String\0")?;
            if interface(MKL_INTERFACE_LP64) != MKL_INTERFACE_LP64 {
                return Err("MKL did not take the LP64 interface (32-bit integers)".into());
            }
            if threading(MKL_THREADING_SEQUENTIAL) != MKL_THREADING_SEQUENTIAL {
                return Err("MKL did not take the sequential threading layer".into());
            }
            if cbwr(MKL_CBWR_AUTO | MKL_CBWR_STRICT) != MKL_CBWR_SUCCESS {
                return Err("MKL refused strict numerical reproducibility (CBWR)".into());
            }
            let mut buf = [0 as c_char; 256];
            version(buf.as_mut_ptr(), buf.len() as c_int);
            let version = std::ffi::CStr::from_ptr(buf.as_ptr())
                .to_string_lossy()
                .trim()
                .to_string();
            Ok(Mkl {
                _lib: lib,
                sgemm,
                gemm_bf16,
                path: path.to_string(),
                version,
            })
        }
    }
}

/// The function `name` (NUL-terminated) of `lib`, as `T`; the error names what is missing.
///
/// # Safety
/// `T` must be the C signature of that function.
unsafe fn symbol<T: Copy>(
    lib: &libloading::Library,
    name: &[u8],
) -> std::result::Result<T, String> {
    lib.get::<T>(name).map(|f| *f).map_err(|e| e.to_string())
}

/// The process's MKL: opened once, from `FLASH_RING_MKL` or else the loader's search path
/// (`libmkl_rt.so.3`, `.so.2`, `.so`); the error says where it looked and why it failed.
pub fn mkl() -> std::result::Result<&'static Mkl, String> {
    static MKL: OnceLock<std::result::Result<Mkl, String>> = OnceLock::new();
    MKL.get_or_init(|| match std::env::var(MKL_ENV) {
        Ok(path) if !path.is_empty() => {
            Mkl::open(&path).map_err(|e| format!("{MKL_ENV}={path}: {e}"))
        }
        _ => {
            let mut tried = Vec::new();
            for name in ["libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so"] {
                match Mkl::open(name) {
                    Ok(m) => return Ok(m),
                    Err(e) => tried.push(e),
                }
            }
            Err(format!(
                "libmkl_rt not found ({MKL_ENV} is not set; the loader's search path gave: {})",
                tried.join("; ")
            ))
        }
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// Whether this CPU has AMX-BF16 and AMX tiles (CPUID leaf 7; MKL checks the OS's support
/// itself and falls back to AVX-512 without it).
pub fn amx_bf16() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::__cpuid_count;
            // Leaf 7 is valid when the largest leaf is at least 7.
            if __cpuid_count(0, 0).eax < 7 {
                return false;
            }
            let edx = __cpuid_count(7, 0).edx;
            edx & (1 << 22) != 0 && edx & (1 << 24) != 0
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Where a product's dtype runs under a [`Gemm`] choice: `Some(mkl)` for MKL, `None` for
/// flash-ring's kernels. `bf16` says whether the operands are bf16 (f32 and f16 otherwise).
/// The one place that decides it ([`crate::matmul`], [`describe`]).
pub fn route(gemm: Gemm, bf16: bool) -> Result<Option<&'static Mkl>> {
    let gemm = match gemm {
        Gemm::Auto => from_env()?,
        g => g,
    };
    match gemm {
        Gemm::Native => Ok(None),
        Gemm::Mkl => mkl().map(Some).map_err(Error::Gemm),
        Gemm::Auto => Ok((bf16 && amx_bf16()).then(|| mkl().ok()).flatten()),
    }
}

impl Gemm {
    /// `auto`, `native` or `mkl` (any case); the error lists them.
    fn parse(s: &str) -> std::result::Result<Gemm, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Gemm::Auto),
            "native" => Ok(Gemm::Native),
            "mkl" => Ok(Gemm::Mkl),
            _ => Err("expected auto, native or mkl".into()),
        }
    }
}

impl std::str::FromStr for Gemm {
    type Err = Error;

    /// `auto`, `native` or `mkl` (any case); the error lists them.
    fn from_str(s: &str) -> Result<Gemm> {
        Gemm::parse(s).map_err(|e| Error::Gemm(format!("{s:?}: {e}")))
    }
}

/// `FLASH_RING_GEMM` (read once): `auto` when unset or empty; the error names the variable.
fn from_env() -> Result<Gemm> {
    static ENV: OnceLock<std::result::Result<Option<Gemm>, String>> = OnceLock::new();
    super::env_choice(&ENV, GEMM_ENV, Gemm::parse)
        .map(Option::unwrap_or_default)
        .map_err(Error::Gemm)
}

/// What runs a product of bf16 (`bf16`) or f32/f16 operands under `gemm`, in words: MKL's
/// version (with `AMX-BF16` when the CPU has it) or flash-ring's kernels. The same routing as
/// the products themselves, errors included.
pub fn describe(gemm: Gemm, bf16: bool) -> Result<String> {
    Ok(match route(gemm, bf16)? {
        Some(lib) => format!(
            "MKL ({}; {}{})",
            lib.version,
            lib.path,
            if amx_bf16() {
                "; this CPU has AMX-BF16"
            } else {
                "; this CPU has no AMX"
            }
        ),
        None => "flash-ring's kernels".to_string(),
    })
}

/// An element MKL multiplies: f32 or bf16, each with its product function.
pub trait MklElem: Copy + Default + Send + Sync {
    /// MKL's product of two matrices of this element (f32 results).
    fn function(mkl: &Mkl) -> GemmFn<Self>;
}

impl MklElem for f32 {
    fn function(mkl: &Mkl) -> GemmFn<f32> {
        mkl.sgemm
    }
}

impl MklElem for bf16 {
    fn function(mkl: &Mkl) -> GemmFn<bf16> {
        mkl.gemm_bf16
    }
}

/// How MKL reads a strided operand: (transposed?, leading dimension), or `None` when neither
/// stride is 1 (or the leading dimension is too short), and the operand must be copied.
fn operand<T>(m: &Mat<T>) -> Option<(c_int, usize)> {
    if m.cs == 1 && (m.rows == 1 || m.rs >= m.cols) {
        Some((CBLAS_NO_TRANS, if m.rows == 1 { m.cols } else { m.rs }))
    } else if m.rs == 1 && (m.cols == 1 || m.cs >= m.rows) {
        Some((CBLAS_TRANS, if m.cols == 1 { m.rows } else { m.cs }))
    } else {
        None
    }
}

/// `C = A B` on MKL: C `(m, n)` row-major f32, or `None` when a dimension does not fit MKL's
/// 32-bit integers (the caller then uses flash-ring's kernels).
pub fn gemm<T: MklElem>(mkl: &Mkl, a: Mat<T>, b: Mat<T>) -> Option<Vec<f32>> {
    if let Some(trivial) = trivial_product(&a, &b) {
        return Some(trivial);
    }
    let (m, k, n) = (a.rows, a.cols, b.cols);
    let (a_copy, b_copy);
    let (a, (ta, lda)) = match operand(&a) {
        Some(o) => (a, o),
        None => {
            a_copy = to_row_major(&a);
            (Mat::row_major(&a_copy, m, k), (CBLAS_NO_TRANS, k.max(1)))
        }
    };
    let (b, (tb, ldb)) = match operand(&b) {
        Some(o) => (b, o),
        None => {
            b_copy = to_row_major(&b);
            (Mat::row_major(&b_copy, k, n), (CBLAS_NO_TRANS, n.max(1)))
        }
    };
    let fits = |x: usize| c_int::try_from(x).is_ok();
    if ![m, n, k, lda, ldb].into_iter().all(fits) {
        return None;
    }
    let mut c = vec![0.0f32; m * n];
    let out = OutPtr(c.as_mut_ptr());
    let (row_tiles, col_tiles) = (m.div_ceil(TILE_ROWS), n.div_ceil(TILE_COLS));
    (0..row_tiles * col_tiles).into_par_iter().for_each(|t| {
        let (r0, c0) = ((t / col_tiles) * TILE_ROWS, (t % col_tiles) * TILE_COLS);
        let (rows, cols) = (TILE_ROWS.min(m - r0), TILE_COLS.min(n - c0));
        // SAFETY: the tiles are disjoint blocks of C (m x n, row stride n), each written by one
        // task; the operands' extents were checked by `trivial_product`, and the offsets
        // below stay inside them (row r0 of A, column c0 of B).
        unsafe {
            T::function(mkl)(
                CBLAS_ROW_MAJOR,
                ta,
                tb,
                rows as c_int,
                cols as c_int,
                k as c_int,
                1.0,
                a.data.as_ptr().add(r0 * a.rs),
                lda as c_int,
                b.data.as_ptr().add(c0 * b.cs),
                ldb as c_int,
                0.0,
                out.get().add(r0 * n + c0),
                n as c_int,
            );
        }
    });
    Some(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The layouts the linear layers hand over (row-major x, column-major W^T, a single row or
    /// column) reach MKL in place with the right leading dimension; only a layout without a
    /// unit stride, or with rows that overlap, is copied (`None`).
    #[test]
    fn operands_are_read_in_place_where_a_stride_is_one() {
        let d = [0.0f32; 64];
        let mat = |rows, cols, rs, cs| Mat {
            data: &d,
            rows,
            cols,
            rs,
            cs,
        };
        assert_eq!(operand(&mat(3, 4, 4, 1)), Some((CBLAS_NO_TRANS, 4)));
        assert_eq!(operand(&mat(3, 4, 6, 1)), Some((CBLAS_NO_TRANS, 6)));
        assert_eq!(operand(&mat(3, 4, 1, 3)), Some((CBLAS_TRANS, 3)));
        assert_eq!(operand(&mat(3, 4, 1, 5)), Some((CBLAS_TRANS, 5)));
        // One row, whatever its row stride: the leading dimension is its length.
        assert_eq!(operand(&mat(1, 4, 0, 1)), Some((CBLAS_NO_TRANS, 4)));
        // One column, whatever its column stride.
        assert_eq!(operand(&mat(4, 1, 1, 0)), Some((CBLAS_TRANS, 4)));
        // No unit stride, or rows (columns) that overlap: copied.
        assert_eq!(operand(&mat(3, 4, 8, 2)), None);
        assert_eq!(operand(&mat(3, 4, 2, 1)), None);
        assert_eq!(operand(&mat(3, 4, 0, 1)), None);
        assert_eq!(operand(&mat(3, 4, 1, 2)), None);
    }
}
