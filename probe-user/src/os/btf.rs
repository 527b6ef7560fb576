//! Just enough of a BTF reader to find struct member offsets in the running kernel
//! (/sys/kernel/btf/vmlinux), for the kernel programs' task → file walk (see probe-common::kernel).
//! Format: Documentation/bpf/btf.rst (header, type section, string section).
use probe_common::kernel::KernelOffsets;

const MAGIC: u16 = 0xeb9f;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_ENUM: u32 = 6;
const KIND_ENUM64: u32 = 19;
const KIND_TYPEDEF: u32 = 8;
const KIND_VOLATILE: u32 = 9;
const KIND_CONST: u32 = 10;
const KIND_RESTRICT: u32 = 11;
const KIND_TYPE_TAG: u32 = 18;

pub struct Btf {
    data: Vec<u8>,
    type_start: usize,
    str_start: usize,
    str_len: usize,
    /// Byte offset (from type_start) of type id i+1.
    types: Vec<usize>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BtfError {
    #[error("not BTF data (bad magic or header)")]
    BadHeader,
    #[error("BTF type section is truncated or corrupt at byte {0}")]
    Corrupt(usize),
    #[error("struct {0} not found in kernel BTF")]
    NoStruct(String),
    #[error("member {1} not found in struct {0}")]
    NoMember(String, String),
}

impl Btf {
    pub fn parse(data: Vec<u8>) -> Result<Self, BtfError> {
        let u32_at = |d: &[u8], o: usize| d.get(o..o + 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        if data.len() < 24 || u16::from_le_bytes([data[0], data[1]]) != MAGIC {
            return Err(BtfError::BadHeader);
        }
        let hdr_len = u32_at(&data, 4).ok_or(BtfError::BadHeader)? as usize;
        let field = |i: usize| u32_at(&data, 8 + 4 * i).map(|v| v as usize).ok_or(BtfError::BadHeader);
        let (type_off, type_len, str_off, str_len) = (field(0)?, field(1)?, field(2)?, field(3)?);
        let type_start = hdr_len + type_off;
        let str_start = hdr_len + str_off;
        if type_start + type_len > data.len() || str_start + str_len > data.len() {
            return Err(BtfError::BadHeader);
        }
        let mut types = Vec::new();
        let mut pos = 0usize;
        while pos < type_len {
            let info = u32_at(&data, type_start + pos + 4).ok_or(BtfError::Corrupt(pos))?;
            let vlen = (info & 0xffff) as usize;
            let kind = (info >> 24) & 0x1f;
            let extra = match kind {
                1 | 14 | 17 => 4,          // INT, VAR, DECL_TAG
                3 => 12,                   // ARRAY
                4 | 5 | 15 => 12 * vlen,   // STRUCT, UNION, DATASEC
                6 | 13 => 8 * vlen,        // ENUM, FUNC_PROTO
                19 => 12 * vlen,           // ENUM64
                2 | 7..=12 | 16 | 18 => 0, // PTR, FWD, TYPEDEF, VOLATILE, CONST, RESTRICT, FUNC, FLOAT, TYPE_TAG
                _ => return Err(BtfError::Corrupt(pos)),
            };
            types.push(pos);
            pos += 12 + extra;
        }
        Ok(Self { data, type_start, str_start, str_len, types })
    }

    pub fn from_sys_fs() -> std::io::Result<Result<Self, BtfError>> {
        Ok(Self::parse(std::fs::read("/sys/kernel/btf/vmlinux")?))
    }

    fn u32(&self, off: usize) -> u32 {
        self.data.get(off..off + 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).unwrap_or(0)
    }

    fn name(&self, name_off: u32) -> &[u8] {
        let start = self.str_start + name_off as usize;
        let end = self.str_start + self.str_len;
        let s = self.data.get(start..end).unwrap_or_default();
        &s[..s.iter().position(|&c| c == 0).unwrap_or(s.len())]
    }

    /// (name_off, info, size_or_type, byte offset of the type record) of type `id` (1-based).
    fn ty(&self, id: u32) -> Option<(u32, u32, u32, usize)> {
        let off = self.type_start + *self.types.get((id as usize).checked_sub(1)?)?;
        Some((self.u32(off), self.u32(off + 4), self.u32(off + 8), off))
    }

    fn strip(&self, mut id: u32) -> u32 {
        for _ in 0..16 {
            match self.ty(id) {
                Some((_, info, t, _))
                    if matches!((info >> 24) & 0x1f, KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT | KIND_TYPE_TAG) =>
                {
                    id = t
                }
                _ => break,
            }
        }
        id
    }

    fn struct_id(&self, name: &str) -> Option<u32> {
        (1..=self.types.len() as u32).find(|&id| {
            self.ty(id)
                .is_some_and(|(n, info, _, _)| (info >> 24) & 0x1f == KIND_STRUCT && (info & 0xffff) > 0 && self.name(n) == name.as_bytes())
        })
    }

    /// Byte offset of `member` in struct/union `id`, looking into anonymous members; and its type.
    fn member_in(&self, id: u32, member: &str) -> Option<(u32, u32)> {
        let (_, info, _, off) = self.ty(id)?;
        let kind = (info >> 24) & 0x1f;
        if kind != KIND_STRUCT && kind != KIND_UNION {
            return None;
        }
        let bitfield = info >> 31 == 1;
        for i in 0..(info & 0xffff) as usize {
            let m = off + 12 + 12 * i;
            let (name_off, mtype, moff) = (self.u32(m), self.u32(m + 4), self.u32(m + 8));
            let bits = if bitfield { moff & 0xff_ffff } else { moff };
            let name = self.name(name_off);
            if name == member.as_bytes() {
                return Some((bits / 8, mtype));
            }
            if name.is_empty()
                && let Some((inner, t)) = self.member_in(self.strip(mtype), member)
            {
                return Some((bits / 8 + inner, t));
            }
        }
        None
    }

    /// Byte offset of a dotted member path ("f_path.dentry") in struct `name`.
    pub fn offset(&self, name: &str, path: &str) -> Result<u32, BtfError> {
        let mut id = self.struct_id(name).ok_or_else(|| BtfError::NoStruct(name.into()))?;
        let mut total = 0;
        for part in path.split('.') {
            let (off, t) = self.member_in(id, part).ok_or_else(|| BtfError::NoMember(name.into(), path.into()))?;
            total += off;
            id = self.strip(t);
        }
        Ok(total)
    }

    /// The offsets the kernel programs use to name the file behind an fd.
    pub fn kernel_offsets(&self) -> Result<KernelOffsets, BtfError> {
        let blk = (|| -> Result<[u32; 7], BtfError> {
            Ok([
                self.offset("request", "__sector")?,
                self.offset("request", "q")?,
                self.offset("request_queue", "disk")?,
                self.offset("gendisk", "major")?,
                self.offset("gendisk", "first_minor")?,
                self.offset("request", "__data_len")?,
                self.offset("request", "cmd_flags")?,
            ])
        })();
        let [rq_sector, rq_q, q_disk, disk_major, disk_first_minor, rq_data_len, rq_cmd_flags] = blk.as_ref().copied().unwrap_or_default();
        let bio = (|| -> Result<[u32; 10], BtfError> {
            Ok([
                self.offset("request", "bio")?,
                self.offset("bio", "bi_blkg")?,
                self.offset("blkcg_gq", "blkcg")?,
                self.offset("blkcg", "css.cgroup")?,
                self.offset("cgroup", "kn")?,
                self.offset("kernfs_node", "id")?,
                self.offset("bio", "bi_io_vec")?,
                self.offset("bio_vec", "bv_page")?,
                self.offset("page", "mapping")?,
                self.offset("address_space", "host")?,
            ])
        })();
        let [rq_bio, bio_blkg, blkg_blkcg, blkcg_cgroup, cgroup_kn, kn_id, bio_io_vec, bvec_page, page_mapping, mapping_host] =
            bio.as_ref().copied().unwrap_or_default();
        // A CPU's accounted steal, from the current task: all three or none.
        let steal = (|| -> Result<[u32; 3], BtfError> {
            Ok([self.offset("task_struct", "se.cfs_rq")?, self.offset("cfs_rq", "rq")?, self.offset("rq", "prev_steal_time_rq")?])
        })()
        .unwrap_or_default();
        // A socket's network namespace: both or none.
        let netns =
            (|| -> Result<[u32; 2], BtfError> { Ok([self.offset("sock_common", "skc_net.net")?, self.offset("net", "ns.inum")?]) })()
                .unwrap_or_default();
        let req_bits = ["__REQ_PREFLUSH", "__REQ_FUA", "__REQ_RAHEAD", "__REQ_SYNC", "__REQ_META"]
            .map(|n| self.enumerator(n).and_then(|v| u32::try_from(v).ok()).filter(|&b| b < 32).unwrap_or(probe_common::kernel::NO_BIT));
        Ok(KernelOffsets {
            valid: 1,
            task_files: self.offset("task_struct", "files")?,
            files_fdt: self.offset("files_struct", "fdt")?,
            fdt_max_fds: self.offset("fdtable", "max_fds")?,
            fdt_fd: self.offset("fdtable", "fd")?,
            file_inode: self.offset("file", "f_inode")?,
            file_dentry: self.offset("file", "f_path.dentry")?,
            inode_ino: self.offset("inode", "i_ino")?,
            inode_sb: self.offset("inode", "i_sb")?,
            sb_dev: self.offset("super_block", "s_dev")?,
            dentry_name: self.offset("dentry", "d_name.name")?,
            file_private_data: self.offset("file", "private_data")?,
            socket_sk: self.offset("socket", "sk")?,
            inode_mode: self.offset("inode", "i_mode")?,
            skc_daddr: self.offset("sock_common", "skc_daddr")?,
            skc_rcv_saddr: self.offset("sock_common", "skc_rcv_saddr")?,
            skc_dport: self.offset("sock_common", "skc_dport")?,
            skc_num: self.offset("sock_common", "skc_num")?,
            skc_family: self.offset("sock_common", "skc_family")?,
            skc_v6_daddr: self.offset("sock_common", "skc_v6_daddr")?,
            skc_v6_rcv_saddr: self.offset("sock_common", "skc_v6_rcv_saddr")?,
            skc_state: self.offset("sock_common", "skc_state")?,
            blk_valid: u32::from(blk.is_ok()),
            rq_sector,
            rq_q,
            q_disk,
            disk_major,
            disk_first_minor,
            rq_data_len,
            rq_cmd_flags,
            req_bits,
            task_pid: self.offset("task_struct", "pid")?,
            bio_valid: u32::from(blk.is_ok() && bio.is_ok()),
            rq_bio,
            bio_blkg,
            blkg_blkcg,
            blkcg_cgroup,
            cgroup_kn,
            kn_id,
            bio_io_vec,
            bvec_page,
            page_mapping,
            mapping_host,
            task_cfs_rq: steal[0],
            cfs_rq_rq: steal[1],
            rq_steal: steal[2],
            skc_net: netns[0],
            net_inum: netns[1],
        })
    }

    /// The value of enumerator `name` in any enum of the kernel (ENUM or ENUM64).
    pub fn enumerator(&self, name: &str) -> Option<i64> {
        (1..=self.types.len() as u32).find_map(|id| {
            let (_, info, _, off) = self.ty(id)?;
            let (kind, vlen) = ((info >> 24) & 0x1f, (info & 0xffff) as usize);
            let width = match kind {
                KIND_ENUM => 8,
                KIND_ENUM64 => 12,
                _ => return None,
            };
            (0..vlen).find_map(|i| {
                let e = off + 12 + width * i;
                (self.name(self.u32(e)) == name.as_bytes()).then(|| match kind {
                    KIND_ENUM => i64::from(self.u32(e + 4) as i32),
                    _ => ((u64::from(self.u32(e + 8)) << 32) | u64::from(self.u32(e + 4))) as i64,
                })
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A BTF blob: int; struct inner { int a; int b; }; struct outer { int x; union { inner in; }; }
    fn blob() -> Vec<u8> {
        let strings = b"\0int\0a\0b\0inner\0outer\0x\0in\0REQ_A\0REQ_B\0";
        let s = |name: &str| {
            strings
                .windows(name.len() + 2)
                .position(|w| w[0] == 0 && &w[1..=name.len()] == name.as_bytes() && w[name.len() + 1] == 0)
                .unwrap() as u32
                + 1
        };
        let mut t: Vec<u32> = Vec::new();
        t.extend([s("int"), 1 << 24, 4, 32]); // 1: int
        t.extend([s("inner"), (4 << 24) | 2, 8, s("a"), 1, 0, s("b"), 1, 32]); // 2: struct inner
        t.extend([0, (5 << 24) | 1, 8, s("in"), 2, 0]); // 3: anonymous union { inner in; }
        t.extend([s("outer"), (4 << 24) | 2, 16, s("x"), 1, 0, 0, 3, 64]); // 4: struct outer
        t.extend([0, (6 << 24) | 2, 4, s("REQ_A"), 7, s("REQ_B"), u32::MAX]); // 5: enum { REQ_A = 7, REQ_B = -1 }
        let types: Vec<u8> = t.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut out = Vec::new();
        out.extend(MAGIC.to_le_bytes());
        out.extend([1u8, 0]);
        for v in [24u32, 0, types.len() as u32, types.len() as u32, strings.len() as u32] {
            out.extend(v.to_le_bytes());
        }
        out.extend(types);
        out.extend(strings);
        out
    }

    #[test]
    fn finds_members_through_anonymous_unions() {
        let btf = Btf::parse(blob()).unwrap();
        assert_eq!(btf.offset("inner", "b"), Ok(4));
        assert_eq!(btf.offset("outer", "x"), Ok(0));
        assert_eq!(btf.offset("outer", "in.b"), Ok(12));
        assert_eq!(btf.offset("outer", "nope"), Err(BtfError::NoMember("outer".into(), "nope".into())));
        assert_eq!(btf.offset("missing", "x").unwrap_err(), BtfError::NoStruct("missing".into()));
        assert_eq!((btf.enumerator("REQ_A"), btf.enumerator("REQ_B"), btf.enumerator("REQ_C")), (Some(7), Some(-1), None));
    }

    /// The running kernel's BTF gives every offset and the request flag bits the block programs use.
    #[test]
    fn the_running_kernel_has_the_block_request_layout() {
        let btf = Btf::from_sys_fs().expect("/sys/kernel/btf/vmlinux").expect("parses");
        let k = btf.kernel_offsets().unwrap();
        assert_eq!(k.blk_valid, 1);
        assert!(k.rq_data_len > 0 && k.rq_cmd_flags > 0 && k.rq_sector > 0);
        // A bio's block cgroup and the file of its first page (IO issued for the target by a
        // kworker: the cgroup throttle's, a flusher).
        assert_eq!(k.bio_valid, 1);
        assert!(k.rq_bio > 0 && k.bio_blkg > 0 && k.page_mapping > 0, "{k:?}");
        assert!(k.req_bits.iter().all(|&b| (8..32).contains(&b)), "{:?}", k.req_bits);
    }

    #[test]
    fn rejects_garbage() {
        assert!(matches!(Btf::parse(vec![0; 64]), Err(BtfError::BadHeader)));
        let mut b = blob();
        b[24 + 4 + 3] = 0x7f; // first type's kind := 31
        assert!(matches!(Btf::parse(b), Err(BtfError::Corrupt(0))));
    }
}
