/* TEMPORARY: placeholder generators while the real ones are written. Deleted before commit. */
#include "internal.h"
zb_status_t zb__gen_gpipe(zb_schedule_t *s) { return ZB_FAIL(ZB_ERR_UNSUPPORTED, "stub %p", (void*)s); }
zb_status_t zb__gen_1f1b(zb_schedule_t *s) { return ZB_FAIL(ZB_ERR_UNSUPPORTED, "stub %p", (void*)s); }
zb_status_t zb__gen_interleaved(zb_schedule_t *s) { return ZB_FAIL(ZB_ERR_UNSUPPORTED, "stub %p", (void*)s); }
zb_status_t zb__gen_zb_h1(zb_schedule_t *s) { return ZB_FAIL(ZB_ERR_UNSUPPORTED, "stub %p", (void*)s); }
zb_status_t zb__gen_zb_h2(zb_schedule_t *s) { return ZB_FAIL(ZB_ERR_UNSUPPORTED, "stub %p", (void*)s); }
zb_status_t zb__gen_zb_v(zb_schedule_t *s) { return ZB_FAIL(ZB_ERR_UNSUPPORTED, "stub %p", (void*)s); }
zb_status_t zb__gen_v_half(zb_schedule_t *s) { return ZB_FAIL(ZB_ERR_UNSUPPORTED, "stub %p", (void*)s); }
zb_status_t zb__gen_v_min(zb_schedule_t *s) { return ZB_FAIL(ZB_ERR_UNSUPPORTED, "stub %p", (void*)s); }
zb_status_t zb__gen_auto(zb_schedule_t *s, double l) { (void)l; return ZB_FAIL(ZB_ERR_UNSUPPORTED, "stub %p", (void*)s); }
