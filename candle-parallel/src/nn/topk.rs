//! The `k` largest values of a row in the order PyTorch's CPU `torch.topk` returns them, ties
//! included: what a mixture of experts' router needs to send every token to the experts
//! transformers sends it to.
//!
//! `torch.topk` has no tie rule of its own. ATen's CPU kernel (`topk_impl_loop`) pairs each value
//! with its index and runs libstdc++'s `std::nth_element` on the k-th position followed by
//! `std::sort` of the first `k - 1`, or `std::partial_sort` of the first `k` when `64 k <= n`,
//! with a comparator that looks at the values alone (NaN above everything). Equal values end up
//! in whatever order those algorithms leave them: not by index (in a row of eight equal values
//! the top two are indices 6 and 5). Router probabilities tie whenever router logits do, which
//! bf16 logits often do. This file reproduces those algorithms step for step (introselect with
//! the median-of-three pivot, heap select, introsort with its final insertion sort), so it is
//! hand-written on purpose: no crate sorts in libstdc++'s order. Checked against `torch.topk` on
//! 968 tie-heavy rows, NaN included, both paths, and on organ-pipe rows that exhaust
//! introselect's depth limit (`tests/fixtures/moe/topk.json`, `scripts/make_topk_fixture.py`).

/// A value and its index in the row.
type Item = (f32, u32);

/// ATen's comparator for the largest values: `x` goes before `y`.
fn before(x: &Item, y: &Item) -> bool {
    (x.0.is_nan() && !y.0.is_nan()) || x.0 > y.0
}

/// `floor(log2(n))` for `n >= 1` (libstdc++'s `__lg`).
fn lg(n: usize) -> usize {
    (usize::BITS - 1 - n.leading_zeros()) as usize
}

/// The indices of the `k` largest of `row` (`k` at most the row's length), largest first, in
/// `torch.topk(row, k)`'s order (CPU, `largest=True`, `sorted=True`).
pub(crate) fn torch_top_k(row: &[f32], k: usize) -> Vec<u32> {
    let n = row.len();
    let k = k.min(n);
    if k == 0 {
        return Vec::new();
    }
    let mut a: Vec<Item> = row
        .iter()
        .enumerate()
        .map(|(i, &v)| (v, i as u32))
        .collect();
    if k * 64 <= n {
        partial_sort(&mut a, k);
    } else {
        introselect(&mut a, k - 1, lg(n) * 2);
        sort(&mut a[..k - 1]);
    }
    a[..k].iter().map(|x| x.1).collect()
}

fn insertion_sort(a: &mut [Item]) {
    for i in 1..a.len() {
        if before(&a[i], &a[0]) {
            a[..=i].rotate_right(1);
        } else {
            unguarded_linear_insert(a, i);
        }
    }
}

/// Moves `a[last]` down to its place; some earlier element stops it.
fn unguarded_linear_insert(a: &mut [Item], mut last: usize) {
    let v = a[last];
    while before(&v, &a[last - 1]) {
        a[last] = a[last - 1];
        last -= 1;
    }
    a[last] = v;
}

/// The median of `a[x]`, `a[y]`, `a[z]` swapped into `a[r]`.
fn move_median_to_first(a: &mut [Item], r: usize, x: usize, y: usize, z: usize) {
    let m = if before(&a[x], &a[y]) {
        if before(&a[y], &a[z]) {
            y
        } else if before(&a[x], &a[z]) {
            z
        } else {
            x
        }
    } else if before(&a[x], &a[z]) {
        x
    } else if before(&a[y], &a[z]) {
        z
    } else {
        y
    };
    a.swap(r, m);
}

/// Hoare partition of `a[1..]` around the pivot `a[0]`; returns the cut.
fn unguarded_partition(a: &mut [Item]) -> usize {
    let (mut first, mut last) = (1, a.len());
    loop {
        while before(&a[first], &a[0]) {
            first += 1;
        }
        last -= 1;
        while before(&a[0], &a[last]) {
            last -= 1;
        }
        if first >= last {
            return first;
        }
        a.swap(first, last);
        first += 1;
    }
}

fn partition_pivot(a: &mut [Item]) -> usize {
    let (n, mid) = (a.len(), a.len() / 2);
    move_median_to_first(a, 0, 1, mid, n - 1);
    unguarded_partition(a)
}

fn push_heap(a: &mut [Item], mut hole: usize, top: usize, v: Item) {
    let mut parent = hole.wrapping_sub(1) / 2;
    while hole > top && before(&a[parent], &v) {
        a[hole] = a[parent];
        hole = parent;
        parent = hole.wrapping_sub(1) / 2;
    }
    a[hole] = v;
}

fn adjust_heap(a: &mut [Item], mut hole: usize, n: usize, v: Item) {
    let top = hole;
    let mut child = hole;
    while child < n.saturating_sub(1) / 2 {
        child = 2 * (child + 1);
        if before(&a[child], &a[child - 1]) {
            child -= 1;
        }
        a[hole] = a[child];
        hole = child;
    }
    if n.is_multiple_of(2) && n >= 2 && child == (n - 2) / 2 {
        child = 2 * (child + 1);
        a[hole] = a[child - 1];
        hole = child - 1;
    }
    push_heap(a, hole, top, v);
}

fn make_heap(a: &mut [Item]) {
    let n = a.len();
    if n < 2 {
        return;
    }
    for parent in (0..=(n - 2) / 2).rev() {
        let v = a[parent];
        adjust_heap(a, parent, n, v);
    }
}

/// Moves the heap's top `a[0]` (heap `a[..len]`) to `a[r]` and `a[r]` into the heap.
fn pop_heap(a: &mut [Item], len: usize, r: usize) {
    let v = a[r];
    a[r] = a[0];
    adjust_heap(&mut a[..len], 0, len, v);
}

/// The `m` first of `a` (by `before`) gathered into a heap `a[..m]`.
fn heap_select(a: &mut [Item], m: usize) {
    make_heap(&mut a[..m]);
    for i in m..a.len() {
        if before(&a[i], &a[0]) {
            pop_heap(a, m, i);
        }
    }
}

fn sort_heap(a: &mut [Item]) {
    let mut last = a.len();
    while last > 1 {
        last -= 1;
        pop_heap(a, last, last);
    }
}

/// `std::partial_sort(a, a + m, a + n)`.
fn partial_sort(a: &mut [Item], m: usize) {
    heap_select(a, m);
    sort_heap(&mut a[..m]);
}

/// `std::nth_element` (introselect) placing the `nth` element.
fn introselect(a: &mut [Item], nth: usize, mut depth: usize) {
    let (mut first, mut last) = (0, a.len());
    while last - first > 3 {
        if depth == 0 {
            heap_select(&mut a[first..last], nth - first + 1);
            a.swap(first, nth);
            return;
        }
        depth -= 1;
        let cut = first + partition_pivot(&mut a[first..last]);
        if cut <= nth {
            first = cut;
        } else {
            last = cut;
        }
    }
    insertion_sort(&mut a[first..last]);
}

/// libstdc++'s insertion-sort threshold of `std::sort`.
const THRESHOLD: usize = 16;

fn introsort_loop(a: &mut [Item], mut depth: usize) {
    let mut last = a.len();
    while last > THRESHOLD {
        if depth == 0 {
            partial_sort(&mut a[..last], last);
            return;
        }
        depth -= 1;
        let cut = partition_pivot(&mut a[..last]);
        introsort_loop(&mut a[cut..last], depth);
        last = cut;
    }
}

/// `std::sort`.
fn sort(a: &mut [Item]) {
    if a.is_empty() {
        return;
    }
    introsort_loop(a, lg(a.len()) * 2);
    if a.len() > THRESHOLD {
        insertion_sort(&mut a[..THRESHOLD]);
        for i in THRESHOLD..a.len() {
            unguarded_linear_insert(a, i);
        }
    } else {
        insertion_sort(a);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every row of `tests/fixtures/moe/topk.json` (torch.topk on tie-heavy rows, NaN included,
    /// through both of ATen's paths) gives torch's indices.
    #[test]
    fn ties_break_as_torch_topk_breaks_them() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/moe/topk.json");
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let cases = doc["cases"].as_array().unwrap();
        assert!(cases.len() > 900);
        let (mut partial, mut nth, mut by_index) = (0, 0, 0);
        for c in cases {
            let k = c["k"].as_u64().unwrap() as usize;
            let row: Vec<f32> = c["codes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().map_or(f32::NAN, |v| 0.25 * v as f32))
                .collect();
            let want: Vec<u32> = serde_json::from_value(c["indices"].clone()).unwrap();
            assert_eq!(torch_top_k(&row, k), want, "n {} k {k}: {row:?}", row.len());
            if k * 64 <= row.len() {
                partial += 1;
            } else {
                nth += 1;
            }
            // Rows where torch's order is not "ties to the lower index".
            let mut plain: Vec<u32> = (0..row.len() as u32).collect();
            plain.sort_by(|&a, &b| {
                let (x, y) = (row[a as usize], row[b as usize]);
                (y.is_nan().cmp(&x.is_nan()))
                    .then(y.partial_cmp(&x).unwrap_or(std::cmp::Ordering::Equal))
                    .then(a.cmp(&b))
            });
            plain.truncate(k);
            by_index += usize::from(plain != want);
        }
        assert!(partial > 20 && nth > 500, "{partial} / {nth}");
        // Rows on which introselect reaches its depth limit (heap select) are among them.
        let organ = cases.iter().filter(|c| c["organ"] == true).count();
        assert!(organ >= 10, "{organ} organ-pipe rows");
        assert!(
            by_index > 100,
            "only {by_index} rows differ from the lower-index rule"
        );
    }

    #[test]
    fn lg_is_the_floor_of_log2() {
        for (n, want) in [
            (1, 0),
            (2, 1),
            (3, 1),
            (4, 2),
            (7, 2),
            (8, 3),
            (9, 3),
            (1 << 40, 40),
        ] {
            assert_eq!(lg(n), want, "{n}");
        }
    }

    #[test]
    fn edge_cases() {
        assert!(torch_top_k(&[], 2).is_empty());
        assert!(torch_top_k(&[1.0, 2.0], 0).is_empty());
        assert_eq!(torch_top_k(&[1.0, 3.0, 2.0], 5), vec![1, 2, 0]);
        assert_eq!(torch_top_k(&[1.0, f32::NAN, 2.0], 1), vec![1]);
        // Eight equal values: torch gives 6, 5, 4, 7 (measured), not 0, 1, 2, 3.
        assert_eq!(torch_top_k(&[1.0; 8], 4), vec![6, 5, 4, 7]);
    }
}
