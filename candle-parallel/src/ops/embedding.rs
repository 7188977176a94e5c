//! Embedding lookup whose gradient sums each row's tokens in f32: a custom op on the CPU, a
//! composite of candle ops elsewhere.
//!
//! Why a kernel: candle differentiates `index_select` with `index_add`, which adds each token's
//! gradient to its row in the table's dtype. In bf16 a row's sum then stops growing once it is
//! about 256 times one token's term: a token that occurs 4096 times with gradient 0.5 gets 128
//! where the sum is 2048 (PyTorch's CPU embedding backward does the same; its CUDA one sums in
//! f32). Frequent tokens are exactly the ones that repeat, and more so at long context. Here each
//! row sums its tokens' gradients in f32, in token order, and is rounded once to the dtype. In
//! f32 that is the sum `index_add` makes (from zero, in token order): the same bits.
//!
//! Rows marked `None` (ids of another rank's vocabulary shard) look up zeros and send no
//! gradient: the gradient does not pass through a zero mask, so an infinite gradient of another
//! rank's token cannot turn into `inf · 0 = NaN` in this rank's table.
//!
//! Off the CPU the composite (`index_select`, times a 0/1 mask where rows are `None`) sums the
//! gradients as the device's `index_add` does.

use std::sync::Arc;

use super::{check_float, dispatch_float, strided, Elem};
use candle_core::{bail, CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

const OP: &str = "embedding_lookup";

/// Rows `rows` of `table` `(R, H)` (f32, bf16 or f16), as `(rows.len(), H)`: row `r` for
/// `Some(r)`, zeros for `None`. Differentiable with respect to `table`: row `r`'s gradient is
/// the sum, in f32 and in order, of the output gradients of the positions that looked it up,
/// rounded once to the dtype (see the module docs). An id `>= R` is an error naming it.
pub fn embedding_lookup(table: &Tensor, rows: &[Option<u32>]) -> Result<Tensor> {
    check(table, rows)?;
    if table.device().is_cpu() {
        table.apply_op1(Lookup {
            rows: Arc::new(rows.to_vec()),
        })
    } else {
        composite(table, rows)
    }
}

/// [`embedding_lookup`] from differentiable candle ops, on any device (public so that tests can
/// run it on the CPU): the same values; its gradient sums as the device's `index_add` does (in
/// f32 the kernel's sums, up to the sign of a zero), and other shards' rows pass a 0/1 mask.
#[doc(hidden)]
pub fn embedding_lookup_composite(table: &Tensor, rows: &[Option<u32>]) -> Result<Tensor> {
    check(table, rows)?;
    composite(table, rows)
}

fn check(table: &Tensor, rows: &[Option<u32>]) -> Result<()> {
    check_float(OP, "table", table.dtype())?;
    let (r, _) = table.dims2().map_err(|_| {
        candle_core::Error::Msg(format!(
            "{OP}: table must be (rows, hidden), got shape {:?}",
            table.dims()
        ))
    })?;
    if let Some((pos, id)) = rows
        .iter()
        .enumerate()
        .find_map(|(p, id)| id.filter(|&id| id as usize >= r).map(|id| (p, id)))
    {
        bail!("{OP}: id {id} at position {pos} is out of range for a table of {r} rows");
    }
    Ok(())
}

fn composite(table: &Tensor, rows: &[Option<u32>]) -> Result<Tensor> {
    let n = rows.len();
    let idx: Vec<u32> = rows.iter().map(|r| r.unwrap_or(0)).collect();
    let idx = Tensor::from_vec(idx, n, table.device())?;
    let out = table.index_select(&idx, 0)?;
    if rows.iter().all(Option::is_some) {
        return Ok(out);
    }
    let mask: Vec<f32> = rows
        .iter()
        .map(|r| f32::from(u8::from(r.is_some())))
        .collect();
    let mask = Tensor::from_vec(mask, (n, 1), table.device())?.to_dtype(table.dtype())?;
    out.broadcast_mul(&mask)
}

struct Lookup {
    rows: Arc<Vec<Option<u32>>>,
}

fn lookup<T: Elem>(
    rows: &[Option<u32>],
    s: &CpuStorage,
    l: &Layout,
) -> Result<(CpuStorage, Shape)> {
    let table = strided(T::cpu_storage_as_slice(s)?, l);
    let h = l.dims()[1];
    let len = rows.len() * h;
    // Every row written once (a copy, or zeros): no zero-fill of the whole output first.
    let mut out: Vec<T> = Vec::with_capacity(len);
    if h > 0 {
        let zero = T::from_f32(0.0);
        out.spare_capacity_mut()[..len]
            .par_chunks_mut(h)
            .zip(rows.par_iter())
            .with_min_len((16384 / h).max(1))
            .for_each(|(o, r)| match r {
                Some(r) => {
                    let src = &table[*r as usize * h..][..h];
                    o.iter_mut().zip(src).for_each(|(o, x)| {
                        o.write(*x);
                    });
                }
                None => o.iter_mut().for_each(|o| {
                    o.write(zero);
                }),
            });
        // SAFETY: the chunks above cover all `len` elements (`rows.len()` rows of `h`), and
        // each was written.
        unsafe { out.set_len(len) };
    }
    Ok((T::to_cpu_storage_owned(out), Shape::from((rows.len(), h))))
}

impl CustomOp1 for Lookup {
    fn name(&self) -> &'static str {
        "cpl-embedding-lookup"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        dispatch_float!(self.name(), s, lookup(&self.rows, s, l))
    }

    fn bwd(&self, table: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let dt = grad.apply_op1_no_bwd(&LookupGrad {
            rows: self.rows.clone(),
            table_rows: table.dim(0)?,
        })?;
        Ok(Some(dt))
    }
}

/// Backward of [`Lookup`]: input the output's gradient `(n, H)`, output the table's `(R, H)`.
struct LookupGrad {
    rows: Arc<Vec<Option<u32>>>,
    table_rows: usize,
}

/// The positions looking up each row, grouped by row and in token order within a row (a
/// counting sort): row `r`'s positions are `order[start[r]..start[r + 1]]`.
fn positions_by_row(rows: &[Option<u32>], table_rows: usize) -> (Vec<usize>, Vec<u32>) {
    let mut start = vec![0usize; table_rows + 1];
    for r in rows.iter().flatten() {
        start[*r as usize + 1] += 1;
    }
    for i in 0..table_rows {
        start[i + 1] += start[i];
    }
    let mut next = start.clone();
    let mut order = vec![0u32; start[table_rows]];
    for (p, r) in rows.iter().enumerate() {
        if let Some(r) = r {
            order[next[*r as usize]] = p as u32;
            next[*r as usize] += 1;
        }
    }
    (start, order)
}

fn lookup_grad<T: Elem>(
    op: &LookupGrad,
    s: &CpuStorage,
    l: &Layout,
) -> Result<(CpuStorage, Shape)> {
    let g = strided(T::cpu_storage_as_slice(s)?, l);
    let (n, h) = match l.dims() {
        &[n, h] => (n, h),
        d => bail!("cpl-embedding-lookup-bwd: gradient must be (rows, hidden), got {d:?}"),
    };
    if n != op.rows.len() {
        bail!(
            "cpl-embedding-lookup-bwd: gradient has {n} rows for {} ids",
            op.rows.len()
        );
    }
    let (start, order) = positions_by_row(&op.rows, op.table_rows);
    let mut out = vec![T::from_f32(0.0); op.table_rows * h];
    if h > 0 {
        out.par_chunks_mut(h)
            .enumerate()
            .with_min_len((16384 / h).max(1))
            .for_each_init(
                || vec![0.0f32; h],
                |acc, (r, o)| {
                    let tokens = &order[start[r]..start[r + 1]];
                    if tokens.is_empty() {
                        return;
                    }
                    acc.fill(0.0);
                    for &p in tokens {
                        let gr = &g[p as usize * h..][..h];
                        acc.iter_mut().zip(gr).for_each(|(a, x)| *a += x.to_f32());
                    }
                    o.iter_mut()
                        .zip(acc.iter())
                        .for_each(|(o, a)| *o = T::from_f32(*a));
                },
            );
    }
    Ok((
        T::to_cpu_storage_owned(out),
        Shape::from((op.table_rows, h)),
    ))
}

impl CustomOp1 for LookupGrad {
    fn name(&self) -> &'static str {
        "cpl-embedding-lookup-bwd"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        dispatch_float!(self.name(), s, lookup_grad(self, s, l))
    }
}
