//! GPU shares (issue 15): parts of one GPU in integer hundredths, never floats.
//!
//! Owns the exact decimal form of a share (`"0.25"` ↔ 25 hundredths, refusing anything
//! finer than 0.01) and [`GpuShares`], the GPUs an amount holds only in part: GPU index →
//! hundredths in 1..=99. A share of 100 is a whole GPU and is never stored here (the GPU
//! is then simply a bit of the amount's mask), so "whole" and "four quarters" are the
//! same amount: nothing more fits on either.
//!
//! A count-only request (no GPU chosen yet) keeps its share under [`ANY_GPU`].
//!
//! Also the queues' unit (issue 16): [`hundredths`], the one rule by which an amount's
//! GPUs are counted against its queue, and [`GpuAmount`], such a count as people and the
//! wire read it.

use std::fmt;

use serde::{de, Deserialize, Deserializer, Serialize, Serializer};

/// Hundredths in one whole GPU.
pub const WHOLE: u32 = 100;

/// GPU use in hundredths: `whole` GPUs and `shares` held in part. The one rule by which
/// the queues count GPUs (issue 16 with issue 15): a held container, a task's request and
/// an ask all count this way, so a share of 0.99 counts 99 and never a whole GPU.
pub fn hundredths(whole: u32, shares: &GpuShares) -> u32 {
    whole.saturating_mul(WHOLE).saturating_add(shares.total())
}

/// Hundredths as GPUs, for people and the wire: an integer when whole (`2`), else the
/// exact decimal (`1.98`); serialized the same way, so a whole-GPU figure reads as before.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct GpuAmount(pub u32);

impl GpuAmount {
    pub fn as_f64(self) -> f64 {
        f64::from(self.0) / f64::from(WHOLE)
    }
}

impl fmt::Display for GpuAmount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&format_hundredths(self.0))
    }
}

impl Serialize for GpuAmount {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.0.is_multiple_of(WHOLE) {
            s.serialize_u32(self.0 / WHOLE)
        } else {
            s.serialize_f64(self.as_f64())
        }
    }
}

/// The index under which a count-only request keeps its share (its GPU is not chosen yet).
pub const ANY_GPU: u8 = 64;

/// `25` → `"0.25"`, `50` → `"0.5"`, `100` → `"1"`, `150` → `"1.5"`: the shortest exact
/// decimal of a number of hundredths.
pub fn format_hundredths(h: u32) -> String {
    let (units, rest) = (h / 100, h % 100);
    match rest {
        0 => units.to_string(),
        r if r % 10 == 0 => format!("{units}.{}", r / 10),
        r => format!("{units}.{r:02}"),
    }
}

/// Why a decimal is not a number of hundredths.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HundredthsError {
    #[error("`{0}` is not a decimal number")]
    NotANumber(String),
    #[error("`{0}` is finer than 0.01 (GPU shares go in steps of 0.01)")]
    TooFine(String),
    #[error("`{0}` is too large")]
    TooLarge(String),
}

/// Reads a non-negative decimal exactly as hundredths: `"0.25"`, `".5"`, `"1"`, `"0.50"`.
/// Trailing zeros past two decimals are accepted (`"0.250"`); any other third decimal is
/// [`HundredthsError::TooFine`]. No float is involved, so nothing is lost.
pub fn parse_hundredths(text: &str) -> Result<u32, HundredthsError> {
    let t = text.trim();
    let t = t.strip_prefix('+').unwrap_or(t);
    let not_number = || HundredthsError::NotANumber(text.trim().to_string());
    let (int, frac) = match t.split_once('.') {
        Some((i, f)) => (i, f),
        None => (t, ""),
    };
    if (int.is_empty() && frac.is_empty())
        || !int.chars().all(|c| c.is_ascii_digit())
        || !frac.chars().all(|c| c.is_ascii_digit())
    {
        return Err(not_number());
    }
    let (two, beyond) = frac.split_at(frac.len().min(2));
    if beyond.chars().any(|c| c != '0') {
        return Err(HundredthsError::TooFine(text.trim().to_string()));
    }
    let int = int.trim_start_matches('0');
    if int.len() > 7 {
        return Err(HundredthsError::TooLarge(text.trim().to_string()));
    }
    let units: u32 = if int.is_empty() {
        0
    } else {
        int.parse().map_err(|_| not_number())?
    };
    let cents: u32 = match two.len() {
        0 => 0,
        1 => two.parse::<u32>().map_err(|_| not_number())? * 10,
        _ => two.parse().map_err(|_| not_number())?,
    };
    Ok(units * 100 + cents)
}

/// The GPUs an amount holds in part: sorted by index, each share in 1..=99 hundredths.
/// In a masked amount every index here is also a bit of the mask; in a count-only one
/// the index is [`ANY_GPU`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct GpuShares(Vec<(u8, u8)>);

impl GpuShares {
    pub fn new() -> Self {
        GpuShares(Vec::new())
    }

    /// One share of `hundredths` on GPU `index` (a share of 0 or ≥ 100 gives no entry).
    pub fn one(index: u8, hundredths: u32) -> Self {
        let mut s = GpuShares::new();
        s.set(index, hundredths);
        s
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The share on `index` (0 when the amount does not hold it in part).
    pub fn get(&self, index: u8) -> u32 {
        match self.0.binary_search_by_key(&index, |e| e.0) {
            Ok(i) => u32::from(self.0[i].1),
            Err(_) => 0,
        }
    }

    /// Sets the share on `index`; 0 or a whole GPU (≥ 100) removes the entry.
    pub fn set(&mut self, index: u8, hundredths: u32) {
        match self.0.binary_search_by_key(&index, |e| e.0) {
            Ok(i) if hundredths == 0 || hundredths >= WHOLE => {
                self.0.remove(i);
            }
            Ok(i) => self.0[i].1 = hundredths as u8,
            Err(_) if hundredths == 0 || hundredths >= WHOLE => {}
            Err(i) => self.0.insert(i, (index, hundredths as u8)),
        }
    }

    /// (index, hundredths), ascending by index.
    pub fn iter(&self) -> impl Iterator<Item = (u8, u32)> + '_ {
        self.0.iter().map(|&(i, h)| (i, u32::from(h)))
    }

    /// The GPUs held in part, as a mask ([`ANY_GPU`] is not a bit).
    #[inline]
    pub fn mask(&self) -> u64 {
        self.0
            .iter()
            .filter(|e| e.0 < ANY_GPU)
            .fold(0, |m, e| m | (1u64 << e.0))
    }

    /// Hundredths over all the shares (what they hold together, [`ANY_GPU`] included).
    pub fn total(&self) -> u32 {
        self.0.iter().map(|e| u32::from(e.1)).sum()
    }

    /// The single share of a one-GPU request, if it is fractional.
    pub fn single(&self) -> Option<(u8, u32)> {
        match self.0.as_slice() {
            [(i, h)] => Some((*i, u32::from(*h))),
            _ => None,
        }
    }
}

impl fmt::Display for GpuShares {
    /// `0:0.25,3:0.5` (`any:0.25` for a count-only share).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (n, (i, h)) in self.iter().enumerate() {
            if n > 0 {
                f.write_str(",")?;
            }
            if i == ANY_GPU {
                write!(f, "any:{}", format_hundredths(h))?;
            } else {
                write!(f, "{i}:{}", format_hundredths(h))?;
            }
        }
        Ok(())
    }
}

/// Wire form: `{"0": "0.25", "3": "0.5"}` — GPU index to its share as an exact decimal
/// string. Reading also takes numbers (`0.25`), read through their decimal text.
impl Serialize for GpuShares {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (i, h) in self.iter() {
            let key = if i == ANY_GPU { "any".to_string() } else { i.to_string() };
            m.serialize_entry(&key, &format_hundredths(h))?;
        }
        m.end()
    }
}

impl<'de> Deserialize<'de> for GpuShares {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Share {
            Text(String),
            Num(serde_json::Number),
        }
        let raw: Option<std::collections::BTreeMap<String, Share>> = Option::deserialize(d)?;
        let mut out = GpuShares::new();
        for (k, v) in raw.unwrap_or_default() {
            let index = if k == "any" {
                ANY_GPU
            } else {
                match k.trim().parse::<u8>() {
                    Ok(i) if i < 64 => i,
                    _ => {
                        return Err(de::Error::custom(format!(
                            "gpuShares: `{k}` is not a GPU index (0 to 63)"
                        )))
                    }
                }
            };
            let text = match v {
                Share::Text(t) => t,
                Share::Num(n) => n.to_string(),
            };
            let h = parse_hundredths(&text).map_err(|e| de::Error::custom(format!("gpuShares.{k}: {e}")))?;
            if h == 0 || h >= WHOLE {
                return Err(de::Error::custom(format!(
                    "gpuShares.{k}: a share is above 0 and below 1 (got {text}); a whole GPU is a bit of gpuMask"
                )));
            }
            out.set(index, h);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn decimals_are_read_exactly() {
        for (t, h) in [
            ("0.25", 25),
            (".5", 50),
            ("0.5", 50),
            ("1", 100),
            ("0.01", 1),
            ("0.99", 99),
            ("0.250", 25),
            ("2", 200),
            (" 0.07 ", 7),
            ("1.5", 150),
        ] {
            assert_eq!(parse_hundredths(t), Ok(h), "{t}");
        }
        assert!(matches!(parse_hundredths("0.001"), Err(HundredthsError::TooFine(_))));
        assert!(matches!(parse_hundredths("0.125"), Err(HundredthsError::TooFine(_))));
        for bad in ["", ".", "-0.5", "1e-2", "0,5", "a", "0.5.1"] {
            assert!(
                matches!(parse_hundredths(bad), Err(HundredthsError::NotANumber(_))),
                "{bad}"
            );
        }
        assert!(matches!(
            parse_hundredths("123456789"),
            Err(HundredthsError::TooLarge(_))
        ));
    }

    #[test]
    fn shares_keep_only_parts_of_gpus() {
        let mut s = GpuShares::one(3, 25);
        s.set(0, 50);
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![(0, 50), (3, 25)]);
        assert_eq!(s.mask(), 0x9);
        s.set(3, 100);
        assert_eq!(s.get(3), 0, "a whole GPU is not a share");
        s.set(0, 0);
        assert!(s.is_empty());
        assert_eq!(GpuShares::one(ANY_GPU, 25).mask(), 0);
    }

    #[test]
    fn wire_form_is_exact_decimal_text() {
        let mut s = GpuShares::one(0, 25);
        s.set(5, 7);
        let j = serde_json::to_string(&s).unwrap();
        assert_eq!(j, r#"{"0":"0.25","5":"0.07"}"#);
        assert_eq!(serde_json::from_str::<GpuShares>(&j).unwrap(), s);
        let n: GpuShares = serde_json::from_str(r#"{"1": 0.3}"#).unwrap();
        assert_eq!(n.get(1), 30);
        for bad in [r#"{"64":"0.5"}"#, r#"{"0":"1"}"#, r#"{"0":"0.001"}"#, r#"{"x":"0.5"}"#] {
            assert!(serde_json::from_str::<GpuShares>(bad).is_err(), "{bad}");
        }
    }

    proptest! {
        #[test]
        fn hundredths_round_trip_through_text(h in 0u32..100_000) {
            prop_assert_eq!(parse_hundredths(&format_hundredths(h)), Ok(h));
        }
    }
}
