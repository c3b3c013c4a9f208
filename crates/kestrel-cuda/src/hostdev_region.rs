//! The host device's ops of the spatial stage (`kernels/region.cu`,
//! Moondream's region model in the step): each calls its kernel's host
//! reference ([`crate::reference`]) on bounds-checked host allocations laid
//! out as the device's, as `hostdev_kernels.rs` does for the rest. Cost:
//! linear in the rows' logits and features.

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::hostdev::{disjoint, HostMemory};
use crate::hostdev_kernels::{max_u32, out_rows};
use crate::reference;
use crate::runtime::backend::{
    AcceptValues, FourierFeatures, HiddenF16, SpatialEmbed, SpatialValues,
};
use crate::CudaError;

pub(crate) fn spatial_values(m: &HostMemory, a: &SpatialValues) -> Result<(), CudaError> {
    let n = a.n;
    let (cb, sb) = (a.coord_bins, a.size_bins);
    // SAFETY: read-only, copied out before any write.
    let tokens = unsafe { m.slice::<u32>(a.tokens, n) }?.to_vec();
    let rows = if a.rows != 0 {
        // SAFETY: as above.
        Some(unsafe { m.slice::<u32>(a.rows, n) }?.to_vec())
    } else {
        None
    };
    let pending_len = rows.as_deref().map_or(0, |r| (max_u32(r) + 1) * 3);
    disjoint(&[
        (a.coord_logits, n * cb * 4),
        (a.size_logits, n * 2 * sb * 4),
        (a.size_table, sb * 4),
        (a.values, n * 3 * 4),
        (a.pending, pending_len * 4),
    ])?;
    // SAFETY: the outputs are disjoint from each other and the inputs
    // (checked above).
    let (cl, sl, table, values) = unsafe {
        (
            m.slice::<f32>(a.coord_logits, n * cb)?,
            m.slice::<f32>(a.size_logits, n * 2 * sb)?,
            m.slice::<f32>(a.size_table, sb)?,
            m.slice_mut::<f32>(a.values, n * 3)?,
        )
    };
    let mut pending = match rows {
        // SAFETY: as above.
        Some(_) => Some(unsafe { m.slice_mut::<f32>(a.pending, pending_len)? }),
        None => None,
    };
    for i in 0..n {
        let v = reference::spatial_values(
            tokens[i],
            (&cl[i * cb..(i + 1) * cb], &sl[i * 2 * sb..(i + 1) * 2 * sb]),
            table,
            (a.coord_id, a.size_id),
        );
        values[i * 3..i * 3 + 3].copy_from_slice(&v);
        if let (Some(p), Some(r)) = (pending.as_deref_mut(), rows.as_deref()) {
            let r = r[i] as usize;
            p[r * 3..r * 3 + 3].copy_from_slice(&v);
        }
    }
    Ok(())
}

pub(crate) fn fourier_features(m: &HostMemory, a: &FourierFeatures) -> Result<(), CudaError> {
    let n = a.n;
    let (ch, sh) = (a.coord_half, a.size_half);
    let rows: Vec<usize> = if a.rows != 0 {
        // SAFETY: read-only, copied out before any write.
        let r = unsafe { m.slice::<u32>(a.rows, n) }?;
        r.iter().map(|&r| r as usize).collect()
    } else {
        (0..n).collect()
    };
    let values_len = rows.iter().map(|r| (r + 1) * 3).max().unwrap_or(0);
    disjoint(&[
        (a.values, values_len * 4),
        (a.coord_w, ch * 4),
        (a.size_w, 2 * sh * 4),
        (a.coord_feats, n * 2 * ch * 2),
        (a.size_feats, n * 2 * sh * 2),
    ])?;
    // SAFETY: the outputs are disjoint from each other and the inputs
    // (checked above).
    let (values, cw, sw, cf, sf) = unsafe {
        (
            m.slice::<f32>(a.values, values_len)?,
            m.slice::<f32>(a.coord_w, ch)?,
            m.slice::<f32>(a.size_w, 2 * sh)?,
            m.slice_mut::<f16>(a.coord_feats, n * 2 * ch)?,
            m.slice_mut::<f16>(a.size_feats, n * 2 * sh)?,
        )
    };
    for (i, &r) in rows.iter().enumerate() {
        let v = [values[r * 3], values[r * 3 + 1], values[r * 3 + 2]];
        let (c, s) = reference::fourier_features(v, cw, sw);
        cf[i * 2 * ch..(i + 1) * 2 * ch].convert_from_f32_slice(&c);
        sf[i * 2 * sh..(i + 1) * 2 * sh].convert_from_f32_slice(&s);
    }
    Ok(())
}

pub(crate) fn spatial_embed(m: &HostMemory, a: &SpatialEmbed) -> Result<(), CudaError> {
    let (n, h) = (a.n, a.hidden);
    let tokens: Vec<u32> = if a.rows != 0 {
        // SAFETY: read-only, copied out before any write.
        let rows = unsafe { m.slice::<u32>(a.rows, n) }?.to_vec();
        let len = max_u32(&rows) + 1;
        // SAFETY: as above.
        let t = unsafe { m.slice::<u32>(a.tokens, len) }?;
        rows.iter().map(|&r| t[r as usize]).collect()
    } else {
        // SAFETY: as above.
        unsafe { m.slice::<u32>(a.tokens, n) }?.to_vec()
    };
    disjoint(&[
        (a.x, n * h * 4),
        (a.coord_emb, n * h * 4),
        (a.size_emb, n * h * 4),
    ])?;
    // SAFETY: x is disjoint from both sources (checked above).
    let (x, ce, se) = unsafe {
        (
            m.slice_mut::<f32>(a.x, n * h)?,
            m.slice::<f32>(a.coord_emb, n * h)?,
            m.slice::<f32>(a.size_emb, n * h)?,
        )
    };
    for (i, &t) in tokens.iter().enumerate() {
        let src = if t == a.coord_id {
            ce
        } else if t == a.size_id {
            se
        } else {
            continue;
        };
        x[i * h..(i + 1) * h].copy_from_slice(&src[i * h..(i + 1) * h]);
    }
    Ok(())
}

pub(crate) fn hidden_f16(m: &HostMemory, a: &HiddenF16) -> Result<(), CudaError> {
    let (n, h) = (a.n, a.hidden);
    let out_row = out_rows(m, a.out_row, n)?;
    let out_n = out_row.iter().map(|&o| o + 1).max().unwrap_or(0).max(0) as usize;
    disjoint(&[(a.x, n * h * 4), (a.out, out_n * h * 2)])?;
    // SAFETY: out is disjoint from x (checked above).
    let (x, out) = unsafe {
        (
            m.slice::<f32>(a.x, n * h)?,
            m.slice_mut::<f16>(a.out, out_n * h)?,
        )
    };
    for (i, &o) in out_row.iter().enumerate() {
        if let Ok(o) = usize::try_from(o) {
            out[o * h..(o + 1) * h].convert_from_f32_slice(&x[i * h..(i + 1) * h]);
        }
    }
    Ok(())
}

pub(crate) fn accept_values(m: &HostMemory, a: &AcceptValues) -> Result<(), CudaError> {
    let n = a.n;
    // SAFETY: read-only, copied out before any write.
    let (qo, acc, kv) = unsafe {
        (
            m.slice::<u32>(a.qo, n + 1)?.to_vec(),
            m.slice::<u32>(a.accepted, n)?.to_vec(),
            m.slice::<u32>(a.kv_rows, n)?.to_vec(),
        )
    };
    let rows = qo[n] as usize;
    let pending_len = (max_u32(&kv) + 1) * 3;
    disjoint(&[(a.values, rows * 3 * 4), (a.pending, pending_len * 4)])?;
    // SAFETY: pending is disjoint from values (checked above).
    let (values, pending) = unsafe {
        (
            m.slice::<f32>(a.values, rows * 3)?,
            m.slice_mut::<f32>(a.pending, pending_len)?,
        )
    };
    for i in 0..n {
        let r = (qo[i] + acc[i]) as usize - 1;
        let k = kv[i] as usize;
        pending[k * 3..k * 3 + 3].copy_from_slice(&values[r * 3..r * 3 + 3]);
    }
    Ok(())
}
