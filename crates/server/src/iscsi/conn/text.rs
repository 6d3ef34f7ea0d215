//! Text requests in full feature phase (RFC 7143 §11.10, §6.2): SendTargets (Appendix C) and
//! operational keys, with long answers continued across requests.

use super::{reject, Connection};
use crate::iscsi::writer::OutPdu;
use crate::LiveTarget;
use bytes::Bytes;
use ironsan_proto::negotiate::Negotiator;
use ironsan_proto::pdu::*;
use ironsan_proto::text;
use std::net::SocketAddr;
use std::sync::Arc;

impl Connection {
    pub(super) async fn on_text(&mut self, bhs: &Bhs, t: TextRequest, data: Bytes) {
        // Continuation of a long response: an empty request with our TTT.
        if let Some((h, chunk)) = self.core.text_continue(&t) {
            self.send(vec![OutPdu::status(h, chunk)]).await;
            return;
        }
        let pairs = match text::parse(&data) {
            Ok(p) => p,
            Err(_) => {
                self.send(vec![reject(RejectReason::PROTOCOL_ERROR, bhs)])
                    .await;
                return;
            }
        };
        let mut out: Vec<(String, String)> = Vec::new();
        let mut others = Vec::new();
        for (k, v) in pairs {
            if k == "SendTargets" {
                out.extend(self.send_targets(&v));
            } else {
                others.push((k, v));
            }
        }
        if !others.is_empty() {
            let mut neg = Negotiator::new(&self.shared.cfg.negotiation);
            out.extend(neg.respond_full_feature(&others).pairs);
        }
        let (h, first) = self.core.text_respond(&t, text::encode(&out));
        self.send(vec![OutPdu::status(h, first)]).await;
    }

    /// SendTargets (RFC 7143 §13.3, Appendix C): `All` lists every target (discovery
    /// sessions only); a name lists that target; empty means the session's target.
    fn send_targets(&self, value: &str) -> Vec<(String, String)> {
        let discovery = self.session.target.is_none();
        let rt = self.shared.runtime();
        let mut names: Vec<&Arc<LiveTarget>> = match value {
            "All" if discovery => rt.targets.values().collect(),
            "All" | "" => self.session.target.iter().collect(),
            name => rt.targets.get(name).into_iter().collect(),
        };
        // Only the targets this initiator may log in to (its ACLs; CHAP is checked at login).
        let initiator = &self.session.initiator_name;
        let peer = self.peer.ip();
        names.retain(|t| rt.access(&t.name).allows(initiator, peer));
        names.sort_by(|a, b| a.name.cmp(&b.name));
        let portals = self
            .shared
            .portals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut out = Vec::new();
        for t in names {
            out.push(("TargetName".to_string(), t.name.clone()));
            // The portals of the target's groups, each with its group's tag.
            for p in portals.iter().filter(|p| rt.served_on(&t.name, p.tag)) {
                // A wildcard listener is reached at the address this connection came in on.
                let ip = if p.addr.ip().is_unspecified() {
                    self.local.ip()
                } else {
                    p.addr.ip()
                };
                let addr = SocketAddr::new(ip, p.addr.port());
                out.push(("TargetAddress".to_string(), format!("{addr},{}", p.tag)));
            }
        }
        out
    }
}
