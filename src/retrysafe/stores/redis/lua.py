"""The Lua scripts of the Redis store: the claim, the compare-and-set writes, the
sweep's compare-and-delete and the guards' cell write, with their SHA-1s."""

from __future__ import annotations

import hashlib

# -- Lua -----------------------------------------------------------------------------
# 1-based positions in a record, the same in every layout version: attempts 2,
# created 6, expires 14, lease 22, final 30, status 31 (p=112 c=99 f=102), has
# completed 32, updated 33. Versions 1 and 2 (bytes "1" "2" = 49 50): completed 41,
# lengths F C T (uint32) at 49 53 57, token 61. Version 3 (51): completed 41 only
# if byte 32 is 1, then lengths T F (uint8) C (uint16), then the token. A claim's
# own record carries the claim's ``now`` as its updated_at.

# The parts of a record ``v`` of any version: where its lengths start, where its
# token starts, the token, fingerprint and claim blob lengths, and where the claim
# blob ends.
_PARTS = """
local function parts(v)
  if string.byte(v, 1) == 51 then
    local at = 41
    if string.byte(v, 32) == 1 then
      at = 49
    end
    local t, f, c = struct.unpack('>BBH', v, at)
    return at, at + 4, t, f, at + 3 + t + f + c
  end
  local f, c, t = struct.unpack('>I4I4I4', v, 49)
  return 49, 61, t, f, 60 + f + c + t
end
"""

# KEYS[1] record key; ARGV[1] the new record (attempts 1, created = now), ARGV[2]
# its fingerprint as layouts 2 and 3 store it, ARGV[3] PX ms ("0": no TTL), ARGV[4]
# the fingerprint as layout 1 stored it (its text). The layouts share the first 40
# bytes, so the script reads any. Mirrors retrysafe._model.decide.claimable.
# Claimed: returns attempts * 4 + took_over (0 none, 1 processing, 2 failed).
# Not claimed: returns the live record.
_CLAIM = f"""{_PARTS}
local key = KEYS[1]
local v = redis.call('GET', key)
local new = ARGV[1]
local attempts = 1
local took = 0
if v then
  local version = string.byte(v, 1)
  if version < 49 or version > 51 then
    return v
  end
  local now = struct.unpack('>d', new, 33)
  if struct.unpack('>d', v, 14) > now then
    local status = string.byte(v, 31)
    if status ~= 112 and status ~= 102 then
      return v
    end
    local _, at, t, f = parts(v)
    local fp = ARGV[2]
    if version == 49 then
      fp = ARGV[4]
    end
    if string.sub(v, at + t, at + t + f - 1) ~= fp then
      return v
    end
    if status == 102 then
      if string.byte(v, 30) ~= 0 then
        return v
      end
      took = 2
    elseif struct.unpack('>d', v, 22) > now then
      return v
    else
      took = 1
    end
    attempts = struct.unpack('>I4', v, 2) + 1
    new = string.sub(new, 1, 1) .. struct.pack('>I4', attempts) .. string.sub(v, 6, 13)
      .. string.sub(new, 14)
  end
end
if ARGV[3] == '0' then
  redis.call('SET', key, new)
else
  redis.call('SET', key, new, 'PX', ARGV[3])
end
return attempts * 4 + took
"""

# The compare-and-set scripts: KEYS[1] record key, ARGV[1] the token as the record
# stores it. They act only on a processing record owned by the token, keep its TTL,
# and return 1 if they wrote, else 0. ``lengths`` is where the record's lengths
# start, ``e`` where its claim blob ends.
_CAS = f"""{_PARTS}
local v = redis.call('GET', KEYS[1])
if not v or string.byte(v, 31) ~= 112 then
  return 0
end
local lengths, at, n, _, e = parts(v)
if n ~= #ARGV[1] or string.sub(v, at, at + n - 1) ~= ARGV[1] then
  return 0
end
"""

# Writes a completion's or failure's record ``new``: it keeps the record's expiry and
# TTL, or, given ARGV[at] (a new expires_at, 8 bytes) and ARGV[at + 1] (its PX ms from
# now), moves both (a record without a TTL, a financial one, gets none).
_SETTLE = """
local function settle(new, at)
  if ARGV[at] then
    new = string.sub(new, 1, 13) .. ARGV[at] .. string.sub(new, 22)
    if redis.call('PTTL', KEYS[1]) > 0 then
      redis.call('SET', KEYS[1], new, 'PX', ARGV[at + 1])
      return 1
    end
  end
  redis.call('SET', KEYS[1], new, 'KEEPTTL')
  return 1
end
"""

# ARGV[2] bytes 31-40 (status c, has completed_at 2: the same as updated_at, updated_at),
# ARGV[3] the outcome blob, ARGV[4] and ARGV[5] a new expiry (optional, see _SETTLE).
# A record of version 1 or 2 keeps its layout: completed_at written out (has
# completed_at 1).
_COMPLETE = f"""{_CAS}{_SETTLE}
local head = ARGV[2]
if string.byte(v, 1) ~= 51 then
  local now = string.sub(head, 3, 10)
  head = string.sub(head, 1, 1) .. '\\1' .. now .. now
end
return settle(string.sub(v, 1, 30) .. head .. string.sub(v, lengths, e) .. ARGV[3], 4)
"""

# ARGV[2] bytes 30-31 (final, status f), ARGV[3] updated_at, ARGV[4] the outcome
# blob (absent or empty: no outcome), ARGV[5] and ARGV[6] a new expiry (optional, see
# _SETTLE).
_FAIL = f"""{_CAS}{_SETTLE}
return settle(string.sub(v, 1, 29) .. ARGV[2] .. string.sub(v, 32, 32) .. ARGV[3]
  .. string.sub(v, 41, e) .. (ARGV[4] or ''), 5)
"""

# ARGV[2] lease_until, ARGV[3] updated_at, ARGV[4] the lease's PX ms from now. A
# lease past expires_at also moves expires_at (and a TTL the record has) to its end,
# so a live attempt never expires under its owner.
_RENEW = f"""{_CAS}
local expires = string.sub(v, 14, 21)
local later = struct.unpack('>d', ARGV[2]) > struct.unpack('>d', expires)
if later then
  expires = ARGV[2]
end
local new = string.sub(v, 1, 13) .. expires .. ARGV[2] .. string.sub(v, 30, 32) .. ARGV[3]
  .. string.sub(v, 41)
redis.call('SET', KEYS[1], new, 'KEEPTTL')
if later and redis.call('PTTL', KEYS[1]) > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
end
return 1
"""


# The sweep's compare-and-delete: KEYS[1] record key, ARGV[1] the value the sweep
# read (and judged expired, and archived if financial). Deletes only that value: a
# record claimed again, completed or renewed since is left alone. Returns 1 or 0.
_SWEEP_DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# A versioned cell of retrysafe.guards (see retrysafe._core.cells): one string under
# ``<prefix>cell:<key>`` (never ``<prefix>{...}``, so the sweep's SCAN skips it),
# ``version LF expires_at LF json`` (expires_at empty: never). The compare-and-set:
# KEYS[1] the cell, ARGV[1] the expected version ('' for none live), ARGV[2]
# ``expires_at LF json`` of the new value, ARGV[3] now, ARGV[4] PX ms ('0': no TTL).
# Applies retrysafe._core.cells.writable; returns 1 if it wrote, else 0.
_CELL_WRITE = """
local cur = redis.call('GET', KEYS[1])
local version = 0
local live = false
if cur then
  local a = string.find(cur, '\\n', 1, true)
  local b = string.find(cur, '\\n', a + 1, true)
  version = tonumber(string.sub(cur, 1, a - 1))
  local x = string.sub(cur, a + 1, b - 1)
  live = x == '' or tonumber(x) > tonumber(ARGV[3])
end
if ARGV[1] == '' then
  if live then
    return 0
  end
  version = 0
elseif not live or version ~= tonumber(ARGV[1]) then
  return 0
end
local new = string.format('%d', version + 1) .. '\\n' .. ARGV[2]
if ARGV[4] == '0' then
  redis.call('SET', KEYS[1], new)
else
  redis.call('SET', KEYS[1], new, 'PX', ARGV[4])
end
return 1
"""


def _sha(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


_CLAIM_SHA, _COMPLETE_SHA, _FAIL_SHA, _RENEW_SHA = map(_sha, (_CLAIM, _COMPLETE, _FAIL, _RENEW))
_CELL_WRITE_SHA = _sha(_CELL_WRITE)
#: Script text by SHA-1, to load a script the server does not know (NOSCRIPT).
_SCRIPTS: dict[str, str] = {
    _CLAIM_SHA: _CLAIM,
    _COMPLETE_SHA: _COMPLETE,
    _FAIL_SHA: _FAIL,
    _RENEW_SHA: _RENEW,
    _CELL_WRITE_SHA: _CELL_WRITE,
}
